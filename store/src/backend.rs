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

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn describe_s3(b: &AmazonS3Builder) -> Described {
    let region = b
        .get_config_value(&S3Key::Region)
        .unwrap_or_else(|| "us-east-1".into());
    let truthy = |k: &S3Key| b.get_config_value(k).is_some_and(|v| v == "true");
    let credentials = if env("AWS_SKIP_SIGNATURE").is_some_and(|v| v == "true") {
        "none (unsigned requests: AWS_SKIP_SIGNATURE)".to_owned()
    } else if b.get_config_value(&S3Key::AccessKeyId).is_some() {
        let token = b.get_config_value(&S3Key::Token).is_some();
        format!(
            "static keys from AWS_ACCESS_KEY_ID{}",
            if token { " + AWS_SESSION_TOKEN" } else { "" }
        )
    } else if let (Some(_), Some(role)) = (env("AWS_WEB_IDENTITY_TOKEN_FILE"), env("AWS_ROLE_ARN"))
    {
        format!("web identity (AWS_WEB_IDENTITY_TOKEN_FILE, role {role})")
    } else if b
        .get_config_value(&S3Key::ContainerCredentialsRelativeUri)
        .is_some()
    {
        "container credentials (AWS_CONTAINER_CREDENTIALS_RELATIVE_URI)".to_owned()
    } else if b
        .get_config_value(&S3Key::ContainerCredentialsFullUri)
        .is_some()
    {
        "container credentials (AWS_CONTAINER_CREDENTIALS_FULL_URI)".to_owned()
    } else {
        "instance metadata (IMDSv2)".to_owned()
    };
    // As object_store's `build` chooses: AWS_ENDPOINT_URL_S3 before AWS_ENDPOINT_URL.
    let endpoint = b
        .get_config_value(&S3Key::S3Endpoint)
        .or_else(|| b.get_config_value(&S3Key::Endpoint))
        .map_or_else(
            || format!("https://s3.{region}.amazonaws.com"),
            |e| redacted(&e),
        );
    let virtual_hosted = truthy(&S3Key::VirtualHostedStyleRequest);
    Described {
        backend: "s3",
        credentials,
        endpoint,
        region: Some(region),
        addressing: Some(if virtual_hosted {
            "virtual-hosted"
        } else {
            "path-style"
        }),
    }
}

fn describe_gcs(b: &GoogleCloudStorageBuilder) -> Described {
    let get = |k: GcsKey| b.get_config_value(&k);
    let credentials = if let Some(path) = get(GcsKey::ServiceAccount) {
        format!("service account file {path}")
    } else if get(GcsKey::ServiceAccountKey).is_some() {
        "service account key (GOOGLE_SERVICE_ACCOUNT_KEY)".to_owned()
    } else if let Some(path) = get(GcsKey::ApplicationCredentials) {
        format!("application credentials file {path}")
    } else if get(GcsKey::SkipSignature).is_some_and(|v| v == "true") {
        "none (unsigned requests)".to_owned()
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
    let credentials = if get(AzKey::AccessKey).is_some() {
        "account key (AZURE_STORAGE_ACCOUNT_KEY)".to_owned()
    } else if get(AzKey::SasKey).is_some() {
        "SAS token".to_owned()
    } else if get(AzKey::Token).is_some() {
        "bearer token".to_owned()
    } else if get(AzKey::ClientSecret).is_some() {
        "service principal (client secret)".to_owned()
    } else if get(AzKey::FederatedTokenFile).is_some() {
        "workload identity (federated token file)".to_owned()
    } else if get(AzKey::UseAzureCli).is_some_and(|v| v == "true") {
        "Azure CLI".to_owned()
    } else if get(AzKey::UseEmulator).is_some_and(|v| v == "true") {
        "the storage emulator's well-known key".to_owned()
    } else {
        "managed identity".to_owned()
    };
    let account = get(AzKey::AccountName).unwrap_or_else(|| "ACCOUNT".into());
    // The emulator's address, as object_store finds it (its account is always the emulator's).
    let emulator = get(AzKey::UseEmulator)
        .is_some_and(|v| v == "true")
        .then(|| {
            let url = std::env::var("AZURITE_BLOB_STORAGE_URL")
                .unwrap_or_else(|_| "http://127.0.0.1:10000".into());
            format!("{}/devstoreaccount1", url.trim_end_matches('/'))
        });
    Described {
        backend: "azure",
        credentials,
        endpoint: get(AzKey::Endpoint)
            .map(|e| redacted(&e))
            .or(emulator)
            .unwrap_or_else(|| format!("https://{account}.blob.core.windows.net")),
        region: None,
        addressing: None,
    }
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
