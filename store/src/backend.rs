//! Builds the object_store client for a [`StoreUrl`] from the standard environment (`AWS_*`,
//! `GOOGLE_*`, `AZURE_*`, as object_store's `from_env` reads them) with our timeouts, HTTP/1,
//! a small retry budget and the HTTP tap; and describes it for the startup log
//! ([`Described`]: credential source, endpoint, region, addressing; never a secret).

use std::sync::{Arc, Once};
use std::time::Duration;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey as S3Key};
use object_store::azure::{AzureConfigKey as AzKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey as GcsKey};
use object_store::http::HttpBuilder;
use object_store::local::LocalFileSystem;
use object_store::{BackoffConfig, ClientConfigKey, ObjectStore, RetryConfig};

use crate::error::StoreError;
use crate::options::StoreOptions;
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

/// A built client and its description.
type Built = Result<(Arc<dyn ObjectStore>, Described), StoreError>;

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
        Scheme::Gcs => {
            let mut b = GoogleCloudStorageBuilder::from_env()
                .with_bucket_name(bucket)
                .with_retry(retry(opts))
                .with_http_connector(TapConnector::default());
            for (k, v) in client(opts) {
                b = b.with_config(GcsKey::Client(k), v);
            }
            let d = describe_gcs(&b);
            let s = b.build().map_err(|e| config(e.to_string()))?;
            Ok((Arc::new(s), d))
        }
        Scheme::Azure => azure(bucket, opts, config),
        Scheme::File => {
            // fsync before the rename: a manifest or converted file is never visible under
            // its name before its bytes are on disk (object_store's default is off).
            let s = LocalFileSystem::new_with_prefix(bucket)
                .map_err(|e| config(format!("cannot open the directory: {e}")))?
                .with_fsync(true);
            let d = Described::plain("file", bucket);
            Ok((Arc::new(s), d))
        }
        Scheme::Http | Scheme::Https => {
            let base = format!("{}://{bucket}", url.scheme().as_str());
            let mut b = HttpBuilder::new()
                .with_url(base.clone())
                .with_retry(retry(opts))
                .with_http_connector(TapConnector::default());
            for (k, v) in client(opts) {
                b = b.with_config(k, v);
            }
            if url.scheme() == Scheme::Http {
                b = b.with_config(ClientConfigKey::AllowHttp, "true");
            }
            let s = b.build().map_err(|e| config(e.to_string()))?;
            let d = Described::plain("http", &base);
            Ok((Arc::new(s), d))
        }
    }
}

/// An S3 client of `bucket` from the environment; its configured credential endpoints are
/// credential services to the tap, unless one is its own endpoint.
fn s3(bucket: &str, opts: &StoreOptions, config: impl Fn(String) -> StoreError) -> Built {
    let b = AmazonS3Builder::from_env();
    let tap = TapConnector::with_credential_urls(
        [
            b.get_config_value(&S3Key::ContainerCredentialsFullUri),
            b.get_config_value(&S3Key::StsEndpoint),
        ],
        // The endpoint S3 requests go to (as `describe_s3` names it).
        &[b.get_config_value(&S3Key::S3Endpoint)
            .or_else(|| b.get_config_value(&S3Key::Endpoint))],
    );
    let mut b = b
        .with_bucket_name(bucket)
        .with_retry(retry(opts))
        .with_http_connector(tap);
    for (k, v) in client(opts) {
        b = b.with_config(S3Key::Client(k), v);
    }
    let d = describe_s3(&b);
    let s = b.build().map_err(|e| config(e.to_string()))?;
    Ok((Arc::new(s), d))
}

/// An Azure client of `container` from the environment (as [`s3`]).
fn azure(container: &str, opts: &StoreOptions, config: impl Fn(String) -> StoreError) -> Built {
    let b = MicrosoftAzureBuilder::from_env();
    let tap = TapConnector::with_credential_urls(
        [
            b.get_config_value(&AzKey::MsiEndpoint),
            b.get_config_value(&AzKey::AuthorityHost),
        ],
        &[b.get_config_value(&AzKey::Endpoint)],
    );
    let mut b = b
        .with_container_name(container)
        .with_retry(retry(opts))
        .with_http_connector(tap);
    for (k, v) in client(opts) {
        b = b.with_config(AzKey::Client(k), v);
    }
    let d = describe_azure(&b);
    let s = b.build().map_err(|e| config(e.to_string()))?;
    Ok((Arc::new(s), d))
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

/// Client settings: our timeouts and HTTP/1 (one store was stuck near 250 MB/s on HTTP/2).
fn client(opts: &StoreOptions) -> [(ClientConfigKey, String); 4] {
    let ms = |d: Duration| format!("{}ms", d.as_millis().max(1));
    [
        (ClientConfigKey::ConnectTimeout, ms(opts.connect_timeout)),
        (ClientConfigKey::ReadTimeout, ms(opts.read_timeout)),
        (ClientConfigKey::Timeout, ms(opts.request_timeout)),
        (ClientConfigKey::Http1Only, "true".into()),
    ]
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
        let (os, _) = built.unwrap();
        let shown = format!("{os:?}");
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
