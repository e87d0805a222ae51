//! Builds the object_store clients for a [`StoreUrl`] from the standard environment (`AWS_*`,
//! `GOOGLE_*`, `AZURE_*`, as object_store's `from_env` reads them) with our timeouts, HTTP/1,
//! a small retry budget and the HTTP tap (one client for reads, and where the limits must
//! differ one for uploads and one for an http(s) listing); and describes them for the startup
//! log ([`Described`]: credential source, endpoint, region, addressing; never a secret).

use std::sync::{Arc, Once};
use std::time::Duration;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey as S3Key};
use object_store::azure::{AzureConfigKey as AzKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey as GcsKey};
use object_store::http::HttpBuilder;
use object_store::local::LocalFileSystem;
use object_store::{BackoffConfig, ClientConfigKey, ObjectStore, RetryConfig};

use crate::capped::WEBDAV_LISTING_BYTES;
use crate::error::StoreError;
use crate::options::{MIN_REQUEST_RATE, StoreOptions};
use crate::tap::TapConnector;
use crate::url::{Scheme, StoreUrl, redacted};

/// What a store is and how it authenticates, for logs and status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Described {
    /// `s3`, `gcs`, `azure`, `file`, `http`.
    pub backend: &'static str,
    /// Where credentials come from (`static keys from AWS_ACCESS_KEY_ID`, `instance metadata`).
    pub credentials: String,
    /// The endpoint requests go to.
    pub endpoint: String,
    /// The region, where the service has one.
    pub region: Option<String>,
    /// `path-style` or `virtual-hosted` (S3 only).
    pub addressing: Option<&'static str>,
}

impl Described {
    /// A store with no credentials and no region (local files, tests over `InMemory`).
    pub fn plain(backend: &'static str, endpoint: &str) -> Described {
        Described {
            backend,
            credentials: "none".into(),
            endpoint: endpoint.to_owned(),
            region: None,
            addressing: None,
        }
    }
}

impl std::fmt::Display for Described {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: credentials {}, endpoint {}",
            self.backend, self.credentials, self.endpoint
        )?;
        if let Some(r) = &self.region {
            write!(f, ", region {r}")?;
        }
        if let Some(a) = self.addressing {
            write!(f, ", {a} addressing")?;
        }
        Ok(())
    }
}

/// A built client, with what the [`crate::Store`] over it needs to know of it.
#[derive(Debug)]
pub(crate) struct Client {
    /// The client of every request (of the listing and the uploads too, unless `lister` or
    /// `writer` is set).
    pub os: Arc<dyn ObjectStore>,
    /// The client of the listing, where it needs another: http(s), whose one `PROPFIND`
    /// answer may take far longer than a GET may ([`http_client`]).
    pub lister: Option<Arc<dyn ObjectStore>>,
    /// The client of uploads (a PUT, each part of a multipart upload), where they need
    /// another: S3, GCS and Azure, whose read limit would also bound sending the body
    /// ([`writer_client`]).
    pub writer: Option<Arc<dyn ObjectStore>>,
    /// Its description, for the startup log and status.
    pub described: Described,
    /// The Azure storage account its requests reach, as the client resolved it (the URL's,
    /// else `AZURE_STORAGE_ACCOUNT_NAME`, else the emulator's): it names the bucket's
    /// throttling window, whatever host the URL wrote, or none.
    pub account: Option<String>,
}

impl Client {
    /// A client that lists with itself and reaches no Azure account.
    fn plain(os: Arc<dyn ObjectStore>, described: Described) -> Client {
        Client {
            os,
            lister: None,
            writer: None,
            described,
            account: None,
        }
    }
}

/// A built client.
type Built = Result<Client, StoreError>;

/// reqwest is built without a bundled crypto provider (no aws-lc C build): installs ring's,
/// once, before any client is made. An error means another provider is installed already,
/// which serves as well.
pub(crate) fn install_tls() {
    static TLS: Once = Once::new();
    TLS.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// The client for `url`, and its description.
pub(crate) fn build(url: &StoreUrl, opts: &StoreOptions) -> Built {
    install_tls();
    let config = |reason: String| StoreError::Config {
        url: url.to_string(),
        reason,
    };
    let bucket = url.bucket();
    match url.scheme() {
        Scheme::S3 => s3(bucket, opts, config),
        Scheme::Gcs => gcs(bucket, opts, config),
        Scheme::Azure => azure(url, opts, config),
        Scheme::File => {
            // fsync before the rename: a manifest or converted file is never visible under
            // its name before its bytes are on disk (object_store's default is off).
            let s = LocalFileSystem::new_with_prefix(bucket)
                .map_err(|e| config(format!("cannot open the directory: {e}")))?
                .with_fsync(true);
            let d = Described::plain("file", bucket);
            Ok(Client::plain(Arc::new(s), d))
        }
        Scheme::Http | Scheme::Https => http(url, opts, config),
    }
}

/// The clients of an http(s) store: one for GETs and HEADs with the [`client`] limits, and
/// one for the listing with [`http_client`]'s (a GET that trickles in for 17 minutes is a
/// stuck fetch, to be asked again, not a listing).
fn http(url: &StoreUrl, opts: &StoreOptions, config: impl Fn(String) -> StoreError) -> Built {
    let base = format!("{}://{}", url.scheme().as_str(), url.bucket());
    let make = |settings: Settings| {
        let mut b = HttpBuilder::new()
            .with_url(base.clone())
            .with_retry(retry(opts))
            .with_http_connector(TapConnector::default());
        for (k, v) in settings {
            b = b.with_config(k, v);
        }
        if url.scheme() == Scheme::Http {
            b = b.with_config(ClientConfigKey::AllowHttp, "true");
        }
        b.build().map_err(|e| config(e.to_string()))
    };
    let os: Arc<dyn ObjectStore> = Arc::new(make(client(opts))?);
    let lister: Arc<dyn ObjectStore> = Arc::new(make(http_client(opts))?);
    Ok(Client {
        lister: Some(lister),
        ..Client::plain(os, Described::plain("http", &base))
    })
}

/// An S3 client of `bucket` from the environment; its configured credential endpoints are
/// credential services to the tap, unless one is its own endpoint ([`s3_tap`]).
fn s3(bucket: &str, opts: &StoreOptions, config: impl Fn(String) -> StoreError) -> Built {
    let b = AmazonS3Builder::from_env();
    let tap = s3_tap(&b);
    let b = b
        .with_bucket_name(bucket)
        .with_retry(retry(opts))
        .with_http_connector(tap);
    let [os, writer] = reader_and_writer(
        &b,
        opts,
        |b, k, v| b.with_config(S3Key::Client(k), v),
        |b| Ok(Arc::new(b.build().map_err(|e| config(e.to_string()))?)),
    )?;
    Ok(Client {
        writer: Some(writer),
        ..Client::plain(os, describe_s3(&b))
    })
}

/// The tap of an S3 client: the credential endpoints it is configured with (container
/// credentials, STS, and instance metadata at `AWS_METADATA_ENDPOINT`, a metadata proxy) are
/// credential services, unless one is its own endpoint.
fn s3_tap(b: &AmazonS3Builder) -> TapConnector {
    TapConnector::with_credential_urls(
        [
            b.get_config_value(&S3Key::ContainerCredentialsFullUri),
            b.get_config_value(&S3Key::StsEndpoint),
            b.get_config_value(&S3Key::MetadataEndpoint),
        ],
        // The endpoint S3 requests go to (as `describe_s3` names it).
        &[b.get_config_value(&S3Key::S3Endpoint)
            .or_else(|| b.get_config_value(&S3Key::Endpoint))],
    )
}

/// A GCS client of `bucket` from the environment (as [`s3`]; the tap: [`gcs_tap`]).
fn gcs(bucket: &str, opts: &StoreOptions, config: impl Fn(String) -> StoreError) -> Built {
    let b = GoogleCloudStorageBuilder::from_env();
    let tap = gcs_tap(&b, |k| std::env::var(k).ok());
    let b = b
        .with_bucket_name(bucket)
        .with_retry(retry(opts))
        .with_http_connector(tap);
    let [os, writer] = reader_and_writer(
        &b,
        opts,
        |b, k, v| b.with_config(GcsKey::Client(k), v),
        |b| Ok(Arc::new(b.build().map_err(|e| config(e.to_string()))?)),
    )?;
    Ok(Client {
        writer: Some(writer),
        ..Client::plain(os, describe_gcs(&b))
    })
}

/// The metadata servers object_store asks for GCS tokens where the environment (`env`) names
/// them, each a host with or without a port (its `gcp/credential.rs`: `GCE_METADATA_HOST`,
/// else `GCE_METADATA_ROOT`, then `GCE_METADATA_IP`).
const GCE_METADATA_VARS: [&str; 3] = ["GCE_METADATA_HOST", "GCE_METADATA_ROOT", "GCE_METADATA_IP"];

/// The tap of a GCS client: the metadata servers named in [`GCE_METADATA_VARS`] (asked over
/// plain HTTP) are credential services, unless one is its own endpoint (`GOOGLE_BASE_URL`).
fn gcs_tap(b: &GoogleCloudStorageBuilder, env: impl Fn(&str) -> Option<String>) -> TapConnector {
    TapConnector::with_credential_urls(
        GCE_METADATA_VARS.map(|k| env(k).map(|host| format!("http://{host}"))),
        &[b.get_config_value(&GcsKey::BaseUrl)],
    )
}

/// An Azure client of the container of `url` from the environment (as [`s3`]); the account
/// of an `az://CONTAINER@ACCOUNT.blob.core.windows.net/` URL wins over
/// `AZURE_STORAGE_ACCOUNT_NAME`, as it does in object_store's own `with_url`.
fn azure(url: &StoreUrl, opts: &StoreOptions, config: impl Fn(String) -> StoreError) -> Built {
    let b = MicrosoftAzureBuilder::from_env();
    let tap = TapConnector::with_credential_urls(
        [
            b.get_config_value(&AzKey::MsiEndpoint),
            b.get_config_value(&AzKey::AuthorityHost),
        ],
        &[b.get_config_value(&AzKey::Endpoint)],
    );
    let mut b = b
        .with_container_name(url.bucket())
        .with_retry(retry(opts))
        .with_http_connector(tap);
    if let Some(account) = url.account() {
        b = b.with_account(account);
    }
    let [os, writer] = reader_and_writer(
        &b,
        opts,
        |b, k, v| b.with_config(AzKey::Client(k), v),
        |b| Ok(Arc::new(b.build().map_err(|e| config(e.to_string()))?)),
    )?;
    Ok(Client {
        account: azure_account(&b),
        writer: Some(writer),
        ..Client::plain(os, describe_azure(&b))
    })
}

/// The storage account an Azure client's requests reach, as object_store's `build` resolves
/// it: the one named (the URL's `with_account` wins over `AZURE_STORAGE_ACCOUNT_NAME`), else
/// the emulator's own (`devstoreaccount1`); lowercase, as Azure's names are.
fn azure_account(b: &MicrosoftAzureBuilder) -> Option<String> {
    let named = b.get_config_value(&AzKey::AccountName);
    let emulator = on(b.get_config_value(&AzKey::UseEmulator));
    let account = named.or_else(|| emulator.then(|| "devstoreaccount1".to_owned()))?;
    Some(account.to_ascii_lowercase())
}

/// A small retry budget: the bucket's window reacts to throttling, not long backoffs.
fn retry(opts: &StoreOptions) -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
            base: 2.0,
        },
        max_retries: opts.max_retries,
        retry_timeout: opts.request_timeout * 2,
    }
}

/// A client's settings (object_store's `ClientConfigKey`s).
type Settings = [(ClientConfigKey, String); 4];

/// The two stores of one provider's builder `b`: reads with [`client`]'s settings, uploads
/// with [`writer_client`]'s (`with` sets one client key on a copy, `build` makes the store).
fn reader_and_writer<B: Clone>(
    b: &B,
    opts: &StoreOptions,
    with: impl Fn(B, ClientConfigKey, String) -> B,
    build: impl Fn(B) -> Result<Arc<dyn ObjectStore>, StoreError>,
) -> Result<[Arc<dyn ObjectStore>; 2], StoreError> {
    let make = |settings: Settings| {
        build(
            settings
                .into_iter()
                .fold(b.clone(), |b, (k, v)| with(b, k, v)),
        )
    };
    Ok([make(client(opts))?, make(writer_client(opts))?])
}

/// Client settings: our timeouts and HTTP/1 (one store was stuck near 250 MB/s on HTTP/2).
/// object_store hands `ReadTimeout` to reqwest, which counts it from sending the request to
/// the response head (connecting, sending the body, the server's time to answer), and only
/// then per read of the body: a GET, HEAD or listing page must start to answer within it.
fn client(opts: &StoreOptions) -> Settings {
    let ms = |d: Duration| format!("{}ms", d.as_millis().max(1));
    [
        (ClientConfigKey::ConnectTimeout, ms(opts.connect_timeout)),
        (ClientConfigKey::ReadTimeout, ms(opts.read_timeout)),
        (ClientConfigKey::Timeout, ms(opts.request_timeout)),
        (ClientConfigKey::Http1Only, "true".into()),
    ]
}

/// Client settings of an http(s) store's listing: as [`client`], but one attempt may take as
/// long as the largest WebDAV listing takes at [`MIN_REQUEST_RATE`] (1 GiB: 1024 s).
/// object_store lists with one `PROPFIND` whose answer is the whole tree, collected in one
/// body: under a 60 s limit a 400 MB listing arriving at 5 MB/s failed on every attempt. A
/// body that stops arriving still fails after `read_timeout`. GETs and HEADs keep [`client`]'s
/// limits ([`http`]).
fn http_client(opts: &StoreOptions) -> Settings {
    let listing = Duration::from_secs(WEBDAV_LISTING_BYTES / MIN_REQUEST_RATE);
    client(&StoreOptions {
        request_timeout: opts.request_timeout.max(listing),
        ..opts.clone()
    })
}

/// Client settings of uploads (a PUT, a part of a multipart upload): as [`client`], but the
/// read limit is the whole-request limit. reqwest's read timeout also runs while the request
/// body is sent ([`client`]): under 10 s an 8 MiB part had to go at 0.8 MiB/s, and two parts
/// in flight needed a 14 Mbit/s uplink, or every attempt failed. An upload must still end
/// within `request_timeout` (60 s, or the request size at [`MIN_REQUEST_RATE`]).
fn writer_client(opts: &StoreOptions) -> Settings {
    client(&StoreOptions {
        read_timeout: opts.read_timeout.max(opts.request_timeout),
        ..opts.clone()
    })
}

/// Whether a boolean setting is on, read as object_store reads it (its `config.rs`: `1`,
/// `true`, `on`, `yes`, `y`, any case); unset or unreadable is off (object_store's `build`
/// refuses an unreadable one, so no store is described with it).
fn on(value: Option<String>) -> bool {
    value.is_some_and(|v| {
        matches!(
            v.to_ascii_lowercase().as_str(),
            "1" | "true" | "on" | "yes" | "y"
        )
    })
}

fn describe_s3(b: &AmazonS3Builder) -> Described {
    let get = |k: S3Key| b.get_config_value(&k);
    let region = get(S3Key::Region).unwrap_or_else(|| "us-east-1".into());
    let virtual_hosted = on(get(S3Key::VirtualHostedStyleRequest));
    // As object_store's `build` chooses: AWS_ENDPOINT_URL_S3 before AWS_ENDPOINT_URL, used as
    // given; without one, AWS's own endpoint in the addressing style asked for.
    let endpoint = match get(S3Key::S3Endpoint).or_else(|| get(S3Key::Endpoint)) {
        Some(e) => redacted(&e),
        None if virtual_hosted => {
            let bucket = get(S3Key::Bucket).unwrap_or_else(|| "BUCKET".into());
            format!("https://{bucket}.s3.{region}.amazonaws.com")
        }
        None => format!("https://s3.{region}.amazonaws.com"),
    };
    Described {
        backend: "s3",
        credentials: s3_credentials(b),
        endpoint,
        region: Some(region),
        addressing: Some(if virtual_hosted {
            "virtual-hosted"
        } else {
            "path-style"
        }),
    }
}

/// Where an S3 client's credentials come from, in the order object_store's `build` tries
/// them (from the builder's settings, which `from_env` filled from `AWS_*`).
fn s3_credentials(b: &AmazonS3Builder) -> String {
    let get = |k: S3Key| b.get_config_value(&k);
    if on(get(S3Key::SkipSignature)) {
        "none (unsigned requests: AWS_SKIP_SIGNATURE)".to_owned()
    } else if get(S3Key::AccessKeyId).is_some() {
        let token = get(S3Key::Token).is_some();
        format!(
            "static keys from AWS_ACCESS_KEY_ID{}",
            if token { " + AWS_SESSION_TOKEN" } else { "" }
        )
    } else if let (Some(_), Some(role)) = (get(S3Key::WebIdentityTokenFile), get(S3Key::RoleArn)) {
        format!("web identity (AWS_WEB_IDENTITY_TOKEN_FILE, role {role})")
    } else if get(S3Key::ContainerCredentialsRelativeUri).is_some() {
        "container credentials (AWS_CONTAINER_CREDENTIALS_RELATIVE_URI)".to_owned()
    } else if get(S3Key::ContainerCredentialsFullUri).is_some() {
        // object_store 0.14 uses the full URI only with a token file (EKS Pod Identity);
        // without one it falls through to instance metadata.
        if get(S3Key::ContainerAuthorizationTokenFile).is_some() {
            "EKS Pod Identity (AWS_CONTAINER_CREDENTIALS_FULL_URI)".to_owned()
        } else {
            "instance metadata (IMDSv2; AWS_CONTAINER_CREDENTIALS_FULL_URI is not used without \
             AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE)"
                .to_owned()
        }
    } else {
        "instance metadata (IMDSv2)".to_owned()
    }
}

fn describe_gcs(b: &GoogleCloudStorageBuilder) -> Described {
    let get = |k: GcsKey| b.get_config_value(&k);
    // With SkipSignature object_store fetches no credentials at all, whatever is configured.
    let credentials = if on(get(GcsKey::SkipSignature)) {
        "none (unsigned requests)".to_owned()
    } else if let Some(path) = get(GcsKey::ServiceAccount) {
        format!("service account file {path}")
    } else if get(GcsKey::ServiceAccountKey).is_some() {
        "service account key (GOOGLE_SERVICE_ACCOUNT_KEY)".to_owned()
    } else if let Some(path) = get(GcsKey::ApplicationCredentials) {
        format!("application credentials file {path}")
    } else {
        "application default credentials or the GCE metadata server".to_owned()
    };
    Described {
        backend: "gcs",
        credentials,
        endpoint: get(GcsKey::BaseUrl)
            .map_or_else(|| "https://storage.googleapis.com".into(), |e| redacted(&e)),
        region: None,
        addressing: None,
    }
}

fn describe_azure(b: &MicrosoftAzureBuilder) -> Described {
    let get = |k: AzKey| b.get_config_value(&k);
    let emulator = on(get(AzKey::UseEmulator));
    let account = get(AzKey::AccountName);
    // As object_store's `build` finds it: the emulator's address (and its account, unless
    // one is named) wins over AZURE_STORAGE_ENDPOINT.
    let endpoint = if emulator {
        let url = std::env::var("AZURITE_BLOB_STORAGE_URL")
            .unwrap_or_else(|_| "http://127.0.0.1:10000".into());
        let account = account.as_deref().unwrap_or("devstoreaccount1");
        format!("{}/{account}", redacted(url.trim_end_matches('/')))
    } else {
        let account = account.as_deref().unwrap_or("ACCOUNT");
        get(AzKey::Endpoint)
            .map(|e| redacted(&e))
            .unwrap_or_else(|| format!("https://{account}.blob.core.windows.net"))
    };
    Described {
        backend: "azure",
        credentials: azure_credentials(b, emulator),
        endpoint,
        region: None,
        addressing: None,
    }
}

/// Where an Azure client's credentials come from, in the order object_store's `build` (and
/// its `resolve_credential_auto`) tries them.
fn azure_credentials(b: &MicrosoftAzureBuilder, emulator: bool) -> String {
    let has = |k: AzKey| b.get_config_value(&k).is_some();
    let client = has(AzKey::ClientId) && has(AzKey::AuthorityId);
    let found = if on(b.get_config_value(&AzKey::SkipSignature)) {
        "none (unsigned requests)"
    } else if emulator && has(AzKey::AccessKey) {
        "account key (AZURE_STORAGE_ACCOUNT_KEY)"
    } else if has(AzKey::Token) {
        "bearer token"
    } else if has(AzKey::AccessKey) {
        "account key (AZURE_STORAGE_ACCOUNT_KEY)"
    } else if !emulator && client && has(AzKey::FederatedTokenFile) {
        "workload identity (federated token file)"
    } else if !emulator && client && has(AzKey::ClientSecret) {
        "service principal (client secret)"
    } else if has(AzKey::SasKey) {
        "SAS token"
    } else if emulator {
        "the storage emulator's well-known key"
    } else if on(b.get_config_value(&AzKey::UseAzureCli)) {
        "Azure CLI"
    } else {
        "managed identity"
    };
    found.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A local dataset's manifest and converted files are synced before they are renamed
    /// into place (object_store's default leaves them to the page cache).
    #[test]
    fn a_local_store_syncs_what_it_writes() {
        let dir = std::env::temp_dir().join(format!("sw-fsync-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let url = StoreUrl::parse(&format!("file://{}", dir.display())).unwrap();
        let built = build(&url, &StoreOptions::default());
        let _ = std::fs::remove_dir_all(&dir);
        let shown = format!("{:?}", built.unwrap().os);
        assert!(shown.contains("fsync: true"), "{shown}");
    }

    /// object_store reads a boolean setting as `1`, `TRUE`, `yes`, `on`: the log said
    /// path-style (and named credentials) for a store that was virtual-hosted (or unsigned).
    #[test]
    fn booleans_are_read_as_object_store_reads_them() {
        let b = AmazonS3Builder::new()
            .with_region("eu-west-1")
            .with_bucket_name("bkt")
            .with_config(S3Key::VirtualHostedStyleRequest, "TRUE");
        let d = describe_s3(&b);
        assert_eq!(d.addressing, Some("virtual-hosted"));
        assert_eq!(d.endpoint, "https://bkt.s3.eu-west-1.amazonaws.com");
        let b = AmazonS3Builder::new()
            .with_config(S3Key::VirtualHostedStyleRequest, "0")
            .with_config(S3Key::AccessKeyId, "AKIAX")
            .with_config(S3Key::SkipSignature, "yes");
        let d = describe_s3(&b);
        assert_eq!(d.addressing, Some("path-style"));
        assert!(d.credentials.starts_with("none"), "{d}");
        let b = GoogleCloudStorageBuilder::new()
            .with_config(GcsKey::ServiceAccount, "/sa.json")
            .with_config(GcsKey::SkipSignature, "1");
        assert!(describe_gcs(&b).credentials.starts_with("none"));
        let b = MicrosoftAzureBuilder::new()
            .with_config(AzKey::UseEmulator, "on")
            .with_config(AzKey::Endpoint, "https://elsewhere.example");
        let d = describe_azure(&b);
        assert!(d.endpoint.ends_with("/devstoreaccount1"), "{d}");
        assert_eq!(d.credentials, "the storage emulator's well-known key");
        assert!(on(Some("Y".into())) && !on(Some("off".into())) && !on(None));
    }

    #[test]
    fn an_http_store_gives_the_largest_listing_time_to_arrive() {
        // Before: 60 s for the whole PROPFIND answer (up to 1 GiB): a 400 MB listing at
        // 5 MB/s timed out on every attempt while bytes kept arriving.
        let timeout = |settings: Settings| {
            settings
                .into_iter()
                .find(|(k, _)| *k == ClientConfigKey::Timeout)
                .map(|(_, v)| v)
        };
        let opts = StoreOptions::default();
        assert_eq!(timeout(http_client(&opts)).as_deref(), Some("1024000ms"));
        assert_eq!(timeout(client(&opts)).as_deref(), Some("60000ms"));
        // The stall limit stays; a longer limit already given stays.
        assert!(http_client(&opts).contains(&(ClientConfigKey::ReadTimeout, "10000ms".into())));
        let long = StoreOptions {
            request_timeout: Duration::from_secs(2000),
            ..opts
        };
        assert_eq!(timeout(http_client(&long)).as_deref(), Some("2000000ms"));
    }

    #[test]
    fn uploads_are_not_held_to_the_read_limit() {
        // Before: every request had the 10 s read limit, which reqwest counts until the
        // response head, so also while the body is sent: an 8 MiB part slower than 0.8 MiB/s
        // failed every attempt (an index uploading from a 10 Mbit/s uplink).
        let get = |settings: Settings, key: ClientConfigKey| {
            settings
                .into_iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| v)
        };
        let opts = StoreOptions::default();
        let read = ClientConfigKey::ReadTimeout;
        assert_eq!(get(writer_client(&opts), read).as_deref(), Some("60000ms"));
        assert_eq!(get(client(&opts), read).as_deref(), Some("10000ms"));
        let big = StoreOptions::sized(1 << 30, 8);
        assert_eq!(get(writer_client(&big), read).as_deref(), Some("1024000ms"));
        // Its other limits are a GET's: an upload that stops still fails.
        for key in [ClientConfigKey::ConnectTimeout, ClientConfigKey::Timeout] {
            assert_eq!(get(writer_client(&opts), key), get(client(&opts), key));
        }
        // Built: an S3 store uploads with that client and reads with the 10 s one.
        let url = StoreUrl::parse("s3://bkt/ds").unwrap();
        let built = build(&url, &opts).expect("an S3 store builds from a bucket URL");
        let reads = format!("{:?}", built.os);
        let writes = format!("{:?}", built.writer.expect("an upload client"));
        assert!(reads.contains("\"10000ms\""), "{reads}");
        assert!(
            !writes.contains("\"10000ms\"") && writes.contains("\"60000ms\""),
            "{writes}"
        );
        // An http(s) store is read-only: no upload client.
        let url = StoreUrl::parse("https://files.example/ds").unwrap();
        assert!(build(&url, &opts).unwrap().writer.is_none());
    }

    #[test]
    fn metadata_endpoints_set_in_the_environment_are_credential_services() {
        // Before: a metadata proxy's 404 (an instance with no role) was taken for the store's
        // own (a dataset "not found"), and its 503 halved the bucket's window.
        let b =
            AmazonS3Builder::new().with_config(S3Key::MetadataEndpoint, "http://127.0.0.1:8111");
        assert!(s3_tap(&b).counts_as_credential("http://127.0.0.1:8111/latest/api/token"));
        let plain = s3_tap(&AmazonS3Builder::new());
        assert!(!plain.counts_as_credential("http://127.0.0.1:8111/latest/api/token"));
        // GCS: object_store asks `http://GCE_METADATA_HOST/...` (else `_ROOT`, then `_IP`).
        let env = |k: &str| match k {
            "GCE_METADATA_HOST" => Some("127.0.0.1:8080".to_owned()),
            "GCE_METADATA_IP" => Some("10.0.0.9".to_owned()),
            _ => None,
        };
        let gcs = GoogleCloudStorageBuilder::new();
        let tap = gcs_tap(&gcs, env);
        let token = "/computeMetadata/v1/instance/service-accounts/default/token";
        assert!(tap.counts_as_credential(&format!("http://127.0.0.1:8080{token}")));
        assert!(tap.counts_as_credential(&format!("http://10.0.0.9{token}")));
        assert!(
            !tap.counts_as_credential("http://127.0.0.1/"),
            "another port"
        );
        let root = |k: &str| (k == "GCE_METADATA_ROOT").then(|| "meta.internal".to_owned());
        assert!(gcs_tap(&gcs, root).counts_as_credential("http://meta.internal/x"));
        // Unless it is the store's own endpoint (a test server serving both).
        let own = gcs.with_config(GcsKey::BaseUrl, "http://127.0.0.1:8080");
        assert!(!gcs_tap(&own, env).counts_as_credential("http://127.0.0.1:8080/b/o"));
    }

    #[test]
    fn an_azure_url_naming_its_account_reaches_the_client() {
        // The environment would decide the endpoint; only without one is it the URL's.
        if std::env::vars().any(|(k, _)| k.starts_with("AZURE") || k.starts_with("AZURITE")) {
            return;
        }
        let url = StoreUrl::parse("az://data@myacct.dfs.core.windows.net/ds").unwrap();
        let built = build(&url, &StoreOptions::default()).unwrap();
        let d = built.described;
        assert_eq!(d.endpoint, "https://myacct.blob.core.windows.net", "{d}");
        assert_eq!(built.account.as_deref(), Some("myacct"));
    }

    #[test]
    fn the_azure_account_is_the_one_the_client_resolves() {
        // Named in the URL (`with_account`) or in the environment: the same account, so the
        // same throttling window; before, the window was named by how the URL was written.
        let named = MicrosoftAzureBuilder::new().with_account("MyAcct");
        assert_eq!(azure_account(&named).as_deref(), Some("myacct"));
        let env = MicrosoftAzureBuilder::new().with_config(AzKey::AccountName, "myacct");
        assert_eq!(azure_account(&env).as_deref(), Some("myacct"));
        let emulator = MicrosoftAzureBuilder::new().with_config(AzKey::UseEmulator, "true");
        assert_eq!(
            azure_account(&emulator).as_deref(),
            Some("devstoreaccount1")
        );
        assert_eq!(azure_account(&MicrosoftAzureBuilder::new()), None);
    }

    #[test]
    fn only_an_http_stores_listing_gets_the_long_limit() {
        // Before: one client with the 1024 s limit served the listing and every GET, so a
        // ranged GET trickling in held a fetch for 17 minutes instead of 60 s.
        let url = StoreUrl::parse("https://files.example/ds").unwrap();
        let built = build(&url, &StoreOptions::default()).unwrap();
        let gets = format!("{:?}", built.os);
        let lister = format!("{:?}", built.lister.expect("a listing client"));
        assert!(
            gets.contains("\"60000ms\"") && !gets.contains("\"1024000ms\""),
            "{gets}"
        );
        assert!(lister.contains("\"1024000ms\""), "{lister}");
        // Other stores list with their one client.
        let url = StoreUrl::parse("s3://bkt/ds").unwrap();
        if let Ok(built) = build(&url, &StoreOptions::default()) {
            assert!(built.lister.is_none());
        }
    }

    #[test]
    fn a_full_container_uri_without_its_token_file_is_not_named_as_the_source() {
        // object_store 0.14 uses AWS_CONTAINER_CREDENTIALS_FULL_URI only with a token file.
        let b = AmazonS3Builder::new().with_config(
            S3Key::ContainerCredentialsFullUri,
            "http://169.254.170.23/v1",
        );
        assert!(
            describe_s3(&b).credentials.starts_with("instance metadata"),
            "{}",
            describe_s3(&b)
        );
        let b = b.with_config(S3Key::ContainerAuthorizationTokenFile, "/var/run/token");
        assert!(describe_s3(&b).credentials.starts_with("EKS Pod Identity"));
    }

    #[test]
    fn an_endpoint_secret_holding_a_fragment_character_is_not_logged() {
        // Before: cut at `#` first, and logged as `http://u:pa#...`.
        let b = AmazonS3Builder::new().with_config(S3Key::Endpoint, "http://u:pa#ss@minio:9000");
        let d = describe_s3(&b);
        assert_eq!(d.endpoint, "http://***@minio:9000");
        assert!(
            !d.endpoint.contains("pa") && !d.to_string().contains("pa#ss"),
            "{d}"
        );
    }

    #[test]
    fn the_s3_endpoint_logged_is_the_one_requests_go_to() {
        let b = AmazonS3Builder::new()
            .with_region("eu-west-1")
            .with_config(S3Key::Endpoint, "http://general:9000")
            .with_config(S3Key::S3Endpoint, "http://user:secret@minio:9000/");
        // Before, the log named AWS_ENDPOINT_URL while object_store used AWS_ENDPOINT_URL_S3.
        assert_eq!(describe_s3(&b).endpoint, "http://***@minio:9000/");
        // Logged endpoints lose a userinfo and a query (a SAS token pasted into one).
        let b = MicrosoftAzureBuilder::new()
            .with_config(AzKey::Endpoint, "https://u:p@acct.example/?sv=1&sig=tok3n");
        assert_eq!(describe_azure(&b).endpoint, "https://***@acct.example/?...");
        let b = GoogleCloudStorageBuilder::new()
            .with_config(GcsKey::BaseUrl, "https://gcs.example/?key=tok3n");
        assert_eq!(describe_gcs(&b).endpoint, "https://gcs.example/?...");
        let b = AmazonS3Builder::new().with_config(S3Key::Endpoint, "http://general:9000");
        assert_eq!(describe_s3(&b).endpoint, "http://general:9000");
        let b = AmazonS3Builder::new().with_region("eu-west-1");
        assert_eq!(
            describe_s3(&b).endpoint,
            "https://s3.eu-west-1.amazonaws.com"
        );
    }
}
