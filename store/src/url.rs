//! [`StoreUrl`]: a dataset location in object storage (`s3://bucket/prefix`, `gs://`, `az://`,
//! `file:///dir`, `http(s)://host/path`), parsed with errors that name the URL and the fix.

use crate::error::StoreError;
pub use crate::redact::redacted;
use crate::redact::{is_scheme, userinfo_end};

/// The storage service a URL names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// `s3://BUCKET/PREFIX`: Amazon S3 or an S3-compatible store (`AWS_ENDPOINT_URL`).
    S3,
    /// `gs://BUCKET/PREFIX`: Google Cloud Storage.
    Gcs,
    /// `az://CONTAINER/PREFIX`: Azure Blob Storage (account from `AZURE_STORAGE_ACCOUNT_NAME`),
    /// or `az://CONTAINER@ACCOUNT.blob.core.windows.net/PREFIX` (`.dfs.` too), naming it.
    Azure,
    /// `file:///DIR`: a local directory through the same interface.
    File,
    /// `http://HOST/PATH`: plain HTTP (WebDAV listing), read-only.
    Http,
    /// `https://HOST/PATH`: HTTPS (WebDAV listing), read-only.
    Https,
}

impl Scheme {
    /// Every scheme, with the spelling users write.
    pub const ALL: [(Scheme, &'static str); 6] = [
        (Scheme::S3, "s3"),
        (Scheme::Gcs, "gs"),
        (Scheme::Azure, "az"),
        (Scheme::File, "file"),
        (Scheme::Http, "http"),
        (Scheme::Https, "https"),
    ];

    /// What a store's refusal for good (a [`StoreError::Rejected`]) tells the user to check,
    /// for this kind of store: an http(s) server has no region and no credentials.
    pub fn refusal_check(self) -> &'static str {
        match self {
            Scheme::S3 => {
                "the dataset URL, AWS_REGION and the endpoint (AWS_ENDPOINT_URL_S3, else \
                 AWS_ENDPOINT_URL: the startup log names the one in use)"
            }
            Scheme::Gcs => "the dataset URL and the bucket's name",
            Scheme::Azure => {
                "the dataset URL, the storage account (AZURE_STORAGE_ACCOUNT_NAME) and the \
                 endpoint"
            }
            Scheme::File => "the dataset URL and the directory",
            Scheme::Http | Scheme::Https => "the dataset URL and what the server serves there",
        }
    }

    /// The scheme as written in URLs (`s3`).
    pub fn as_str(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(s, _)| *s == self)
            .map_or("", |(_, n)| n)
    }

    /// Whether the store can be written (the manifest beside the data): not http(s).
    pub fn writable(self) -> bool {
        !matches!(self, Scheme::Http | Scheme::Https)
    }

    fn of(name: &str) -> Option<Scheme> {
        Self::ALL
            .iter()
            .find(|(_, n)| n.eq_ignore_ascii_case(name))
            .map(|(s, _)| *s)
    }
}

/// A parsed dataset location: scheme, bucket (container, host, or for `file://` the
/// directory), prefix (`/`-separated, no leading or trailing `/`) and, for an Azure URL that
/// names one, the storage account's host.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StoreUrl {
    scheme: Scheme,
    bucket: String,
    prefix: String,
    /// `ACCOUNT.blob.core.windows.net` (or `.dfs.`), lowercase, of
    /// `az://CONTAINER@ACCOUNT.blob.core.windows.net/PREFIX`; `None` otherwise.
    account_host: Option<String>,
}

const SCHEMES_HINT: &str = "use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, az://CONTAINER/PREFIX, \
                            file:///DIR or http(s)://HOST/PATH";

/// Whether `c` marks a server's address (`host:port`, `[ipv6]`): no bucket or container
/// name holds one (legacy S3 buckets may hold uppercase letters, so only these are refused).
fn host_char(c: char) -> bool {
    matches!(c, ':' | '[' | ']')
}

impl StoreUrl {
    /// Parses `s`; the error names `s` and says what to write instead.
    pub fn parse(s: &str) -> Result<StoreUrl, StoreError> {
        // Every error repeats `s` without its userinfo, query or fragment: they may hold a
        // key or a signature, and the error goes into logs, the CLI's output and the wire.
        let bad = |reason: String| StoreError::Url {
            url: redacted(s),
            reason,
        };
        let Some((name, rest)) = s.split_once("://") else {
            return Err(bad(format!("not a URL (no scheme://); {SCHEMES_HINT}")));
        };
        let scheme = Scheme::of(name).ok_or_else(|| match is_scheme(name) {
            true => bad(format!("unsupported scheme `{name}`; {SCHEMES_HINT}")),
            false => bad(format!("not a URL (no scheme://); {SCHEMES_HINT}")),
        })?;
        refuse_characters(scheme, rest).map_err(bad)?;
        let parsed = match scheme {
            Scheme::File => Self::parse_file(rest),
            _ => Self::parse_named(scheme, rest),
        };
        parsed.map_err(bad)
    }

    /// `BUCKET/PREFIX` (container, host) of every scheme but `file://`; for Azure also
    /// `CONTAINER@ACCOUNT_HOST/PREFIX` ([`azure_account_host`]).
    fn parse_named(scheme: Scheme, rest: &str) -> Result<StoreUrl, String> {
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (bucket, account_host) = match azure_account_host(scheme, authority) {
            Some((container, host)) => (container, Some(host?)),
            None => (authority, None),
        };
        if bucket.is_empty() {
            let what = match scheme {
                Scheme::Azure => "container",
                Scheme::Http | Scheme::Https => "host",
                _ => "bucket",
            };
            return Err(format!(
                "no {what}; write {}://{}/PREFIX",
                scheme.as_str(),
                what.to_uppercase()
            ));
        }
        let named = matches!(scheme, Scheme::S3 | Scheme::Gcs | Scheme::Azure);
        if named && let Some(c) = bucket.chars().find(|c| host_char(*c)) {
            // `s3://minio:9000/bkt/ds`: a server's address where the bucket goes.
            return Err(format!(
                "`{bucket}` is not a bucket name ({c:?} marks a server's address); a server's \
                 address goes in the environment (AWS_ENDPOINT_URL=http://HOST:PORT for MinIO \
                 or another S3 server), the URL names the bucket: s3://BUCKET/PREFIX"
            ));
        }
        if !named && let Some(fix) = cloud_endpoint(bucket, path) {
            return Err(fix);
        }
        let prefix = clean_prefix(path)?;
        Ok(StoreUrl {
            scheme,
            bucket: bucket.to_owned(),
            prefix,
            account_host,
        })
    }

    /// `file:///abs/dir`: the bucket is the directory, its percent-escapes decoded
    /// (`file:///d/my%20set` is `/d/my set`); the prefix empty.
    fn parse_file(rest: &str) -> Result<StoreUrl, String> {
        let path = match rest.strip_prefix("localhost") {
            Some(p) => p,
            None => rest,
        };
        if !path.starts_with('/') {
            return Err("a file URL needs an absolute path: file:///DIR".into());
        }
        let clean = clean_prefix(&percent_decode(path)?)?;
        Ok(StoreUrl {
            scheme: Scheme::File,
            bucket: format!("/{clean}"),
            prefix: String::new(),
            account_host: None,
        })
    }

    /// Whether `s` starts with a scheme this crate serves (`s3://`, `gs://`, `az://`,
    /// `file://`, `http(s)://`), so that a plain directory path stays local.
    pub fn is_remote(s: &str) -> bool {
        s.split_once("://")
            .is_some_and(|(name, _)| Scheme::of(name).is_some())
    }

    /// The scheme.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// The bucket (container, host; the directory of a `file://` URL).
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The prefix inside the bucket, without leading or trailing `/` (may be empty).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The Azure storage account an `az://CONTAINER@ACCOUNT.blob.core.windows.net/` URL
    /// names (`None`: the environment's `AZURE_STORAGE_ACCOUNT_NAME`, or not Azure).
    pub fn account(&self) -> Option<&str> {
        let host = self.account_host.as_deref()?;
        host.split_once('.').map(|(account, _)| account)
    }

    /// The bucket as the URL writes it: `CONTAINER@ACCOUNT_HOST` for an Azure URL that names
    /// its account, else the bucket (container, host, directory).
    pub(crate) fn authority(&self) -> String {
        match &self.account_host {
            Some(host) => format!("{}@{host}", self.bucket),
            None => self.bucket.clone(),
        }
    }

    /// The full key of `key` (relative to the prefix) inside the bucket.
    pub fn key(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_owned()
        } else {
            format!("{}/{key}", self.prefix)
        }
    }
}

const CREDENTIALS: &str = "credentials in the URL (`user:secret@`) are not accepted: they \
                           would show in logs, errors and metrics; give them in the \
                           environment (docs/CONFIGURATION.md, object storage)";

/// Refuses what no dataset URL may hold (`rest`: the URL after `scheme://`): credentials, a
/// query or fragment, whitespace, and a percent-escape in an http(s) path.
fn refuse_characters(scheme: Scheme, rest: &str) -> Result<(), String> {
    // Looked for in the whole URL, before any cut at `?` or `#`: a secret may hold either
    // (`user:pa#ss@host`), and cut there it would pass as no userinfo at all. An Azure
    // `CONTAINER@ACCOUNT.blob.core.windows.net` holds no secret.
    let authority = rest.split_once('/').map_or(rest, |(a, _)| a);
    if userinfo_end(rest).is_some() && azure_account_host(scheme, authority).is_none() {
        return Err(azure_near_miss(scheme, authority).unwrap_or_else(|| CREDENTIALS.into()));
    }
    if let Some(c) = rest
        .chars()
        .find(|c| matches!(c, '?' | '#') || c.is_whitespace())
    {
        let note = match (c.is_whitespace(), scheme) {
            (true, Scheme::File) => "; in a file URL write a space as %20",
            (true, _) => "",
            (false, Scheme::File) => "; in a file URL write `?` as %3F and `#` as %23",
            (false, _) => {
                "; what follows it is not repeated here (it may be a signature): give \
                 credentials in the environment (docs/CONFIGURATION.md, object storage)"
            }
        };
        return Err(format!(
            "{c:?} is not allowed in a dataset URL (no query, fragment or spaces){note}"
        ));
    }
    if matches!(scheme, Scheme::Http | Scheme::Https) && rest.contains('%') {
        // The client escapes the path itself: `my%20data` would be asked as
        // `my%2520data`, a path the server does not have (an empty listing).
        return Err(
            "a percent-escape (`%`) is not supported in an http(s) dataset \
                    path: serve the dataset under a path of plain characters"
                .into(),
        );
    }
    Ok(())
}

/// Azure's own host names of a storage account's blobs (`.dfs.`: Data Lake Storage Gen2, the
/// same blobs).
const AZURE_HOSTS: [&str; 2] = [".blob.core.windows.net", ".dfs.core.windows.net"];

/// For an `az://` URL whose `authority` (what comes before the first `/`) is
/// `CONTAINER@ACCOUNT.blob.core.windows.net` or `...dfs.core.windows.net` (the form adlfs,
/// Hadoop's abfs and object_store write): the container, and the host lowercased, or why
/// ACCOUNT is no storage account's name. `None` for any other authority, and where CONTAINER
/// is not of a container name's characters (lowercase letters, digits, `-`, `$root`): a
/// `user:secret@` or a token is refused as credentials, never logged as a container.
fn azure_account_host(scheme: Scheme, authority: &str) -> Option<(&str, Result<String, String>)> {
    let (container, host) = authority.split_once('@')?;
    let container_chars = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-';
    let name = container.strip_prefix('$').unwrap_or(container);
    if scheme != Scheme::Azure || !name.bytes().all(container_chars) || host.contains('@') {
        return None;
    }
    let host = host.to_ascii_lowercase();
    let account = AZURE_HOSTS.iter().find_map(|h| host.strip_suffix(*h))?;
    // Azure's rule: 3-24 lowercase letters and digits (object_store refuses a `.` in it).
    let named =
        (3..=24).contains(&account.len()) && account.bytes().all(|b| b.is_ascii_alphanumeric());
    if !named {
        return Some((
            container,
            Err(format!(
                "`{account}` is not a storage account name (3-24 lowercase letters and digits); \
                 write az://CONTAINER@ACCOUNT.blob.core.windows.net/PREFIX, or \
                 az://CONTAINER/PREFIX with AZURE_STORAGE_ACCOUNT_NAME=ACCOUNT"
            )),
        ));
    }
    Some((container, Ok(host)))
}

/// Azure's clouds, by the domain of their storage hosts (`ACCOUNT.blob.DOMAIN`): public, US
/// Government, China.
const AZURE_CLOUDS: [&str; 3] = [
    "core.windows.net",
    "core.usgovcloudapi.net",
    "core.chinacloudapi.cn",
];

/// What to write instead of an `az://` `authority` that [`azure_account_host`] does not take
/// but that means to name an account: after its last `@` an Azure blob or dfs host (of any
/// cloud, with any port), before it what a mistyped container name holds (letters, digits,
/// `-`, `_`, a leading `$`): a port, an uppercase or `_` container name, another cloud's host.
/// `None` for any other authority: a `user:secret@` or a token holds other characters, and
/// stays refused as credentials. Nothing before the `@` is repeated (it may be a secret).
fn azure_near_miss(scheme: Scheme, authority: &str) -> Option<String> {
    let (before, after) = authority.rsplit_once('@')?;
    let typo = |b: u8| b.is_ascii_alphanumeric() || b == b'-' || b == b'_';
    let name = before.strip_prefix('$').unwrap_or(before);
    if scheme != Scheme::Azure || name.is_empty() || !name.bytes().all(typo) {
        return None;
    }
    let host = after.split(':').next().unwrap_or("").to_ascii_lowercase();
    let (account, cloud) = AZURE_CLOUDS.iter().find_map(|cloud| {
        let of = |kind: &str| host.strip_suffix(&format!(".{kind}.{cloud}"));
        of("blob").or_else(|| of("dfs")).map(|a| (a, *cloud))
    })?;
    if cloud == AZURE_CLOUDS[0] {
        return Some(
            "an Azure URL names its account only so: \
             az://CONTAINER@ACCOUNT.blob.core.windows.net/PREFIX (or `.dfs.`), CONTAINER of \
             lowercase letters, digits and `-` (or `$root`), no port; or write \
             az://CONTAINER/PREFIX with AZURE_STORAGE_ACCOUNT_NAME=ACCOUNT"
                .to_owned(),
        );
    }
    let named =
        (3..=24).contains(&account.len()) && account.bytes().all(|b| b.is_ascii_alphanumeric());
    let account = if named { account } else { "ACCOUNT" };
    Some(format!(
        "an account of Azure's `{cloud}` cloud is named in the environment, not the URL: write \
         az://CONTAINER/PREFIX with AZURE_STORAGE_ACCOUNT_NAME={account} and \
         AZURE_STORAGE_ENDPOINT=https://{account}.blob.{cloud} (CONTAINER: lowercase letters, \
         digits and `-`)"
    ))
}

/// The fix for an http(s) URL whose host is a cloud store's own endpoint
/// (`https://BKT.s3.REGION.amazonaws.com/ds`): it serves no WebDAV listing, so the dataset
/// would only fail later, as "refused (HTTP 405)". `None` for any other host.
fn cloud_endpoint(host: &str, path: &str) -> Option<String> {
    let lower = host.to_ascii_lowercase();
    // Cloud endpoints are names, never `[ipv6]`: a `:` ends the name (a port).
    let name = lower.split(':').next().unwrap_or("");
    let path = path.trim_matches('/');
    let (first, after) = path.split_once('/').unwrap_or((path, ""));
    let url = |scheme: &str, bucket: &str, prefix: &str| match (bucket, prefix) {
        ("", _) => format!("{scheme}://BUCKET/PREFIX"),
        (b, "") => format!("{scheme}://{b}"),
        (b, p) => format!("{scheme}://{b}/{p}"),
    };
    let (service, fix) = if let Some(stem) = name
        .strip_suffix(".amazonaws.com")
        .or_else(|| name.strip_suffix(".amazonaws.com.cn"))
    {
        let s3 = |bucket: &str, prefix: &str| {
            let u = url("s3", bucket, prefix);
            format!("{u} (with AWS_REGION; a public bucket: AWS_SKIP_SIGNATURE=true)")
        };
        if stem == "s3" || stem.starts_with("s3.") || stem.starts_with("s3-") {
            ("Amazon S3", s3(first, after)) // path-style: s3.REGION.amazonaws.com/BKT/...
        } else {
            let at = stem.rfind(".s3.").or_else(|| stem.rfind(".s3-"));
            let at = at.or_else(|| stem.strip_suffix(".s3").map(str::len))?;
            ("Amazon S3", s3(&stem[..at], path)) // virtual-hosted: BKT.s3.REGION...
        }
    } else if name == "storage.googleapis.com" || name == "storage.cloud.google.com" {
        ("Google Cloud Storage", url("gs", first, after))
    } else if let Some(bucket) = name.strip_suffix(".storage.googleapis.com") {
        ("Google Cloud Storage", url("gs", bucket, path))
    } else if let Some(account) = AZURE_HOSTS.iter().find_map(|h| name.strip_suffix(*h)) {
        let u = match first {
            "" => "az://CONTAINER/PREFIX".to_owned(),
            _ => url("az", first, after),
        };
        (
            "Azure Blob Storage",
            format!("{u} with AZURE_STORAGE_ACCOUNT_NAME={account}"),
        )
    } else {
        return None;
    };
    Some(format!(
        "`{host}` is {service}'s own endpoint, which serves no WebDAV listing (the dataset \
         could not be listed); write {fix}"
    ))
}

/// `path` of a file URL with each `%XX` decoded; refuses a `%` that starts no escape, and
/// escapes that decode to a NUL or to no UTF-8.
fn percent_decode(path: &str) -> Result<String, String> {
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'%' {
            out.push(bytes[i]);
            i += 1;
            continue;
        }
        // Two hex digits, no sign (`from_str_radix` would take `%+1`).
        let byte = path
            .get(i + 1..i + 3)
            .filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match byte {
            Some(0) | None => {
                return Err(format!(
                    "`{}` in the path is no percent-escape of a file URL (%20 is a space; \
                     write a `%` as %25)",
                    path.get(i..(i + 3).min(path.len())).unwrap_or("%")
                ));
            }
            Some(b) => out.push(b),
        }
        i += 3;
    }
    String::from_utf8(out).map_err(|_| {
        "the path's percent-escapes decode to no UTF-8 text; name the directory in UTF-8".into()
    })
}

/// `path` as a file URL writes it: whitespace, control characters, `%`, `?` and `#`
/// percent-escaped, so that [`StoreUrl::parse`] reads back the same directory.
fn percent_encode(path: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(path.len());
    for c in path.chars() {
        if c.is_whitespace() || c.is_control() || matches!(c, '%' | '?' | '#') {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                let _ = write!(out, "%{b:02X}");
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// `a//b/` -> `a/b`; refuses `.` and `..` segments.
fn clean_prefix(path: &str) -> Result<String, String> {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    if let Some(p) = parts.iter().find(|p| **p == "." || **p == "..") {
        return Err(format!(
            "path segment `{p}` is not allowed; write the prefix out"
        ));
    }
    Ok(parts.join("/"))
}

impl std::fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (s, at) = (self.scheme.as_str(), self.authority());
        match self.scheme {
            Scheme::File => write!(f, "file://{}", percent_encode(&self.bucket)),
            _ if self.prefix.is_empty() => write!(f, "{s}://{at}"),
            _ => write!(f, "{s}://{at}/{}", self.prefix),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(s: &str) -> String {
        StoreUrl::parse(s).unwrap_err().to_string()
    }

    #[test]
    fn a_refusal_names_what_to_check_for_its_kind_of_store() {
        // Before: every refusal said "check the dataset URL, AWS_REGION and the endpoint".
        for (scheme, name) in Scheme::ALL {
            let check = scheme.refusal_check();
            assert!(check.starts_with("the dataset URL"), "{name}: {check}");
            let names_aws = check.contains("AWS_REGION");
            assert_eq!(names_aws, scheme == Scheme::S3, "{name}: {check}");
        }
    }

    #[test]
    fn a_server_address_where_the_bucket_goes_is_refused_naming_the_fix() {
        // Before: bucket `minio:9000`, and a confusing store error later.
        let e = err("s3://minio:9000/bkt/ds");
        assert!(
            e.contains("`minio:9000` is not a bucket name") && e.contains("AWS_ENDPOINT_URL"),
            "{e}"
        );
        assert!(err("s3://[fd00::1]:9000/b").contains("marks a server's address"));
        // A legacy S3 bucket with uppercase letters is a bucket.
        assert!(StoreUrl::parse("s3://MyLegacyBucket/x").is_ok());
        assert!(StoreUrl::parse("s3://my-bucket.v2/x").is_ok());
        assert!(StoreUrl::parse("gs://my_bucket/x").is_ok());
        // A host of an HTTP URL is not a bucket.
        assert!(StoreUrl::parse("http://127.0.0.1:9000/d").is_ok());
    }

    #[test]
    fn parses_every_scheme() {
        let u = StoreUrl::parse("s3://bkt/a/b/").unwrap();
        assert_eq!(
            (u.scheme(), u.bucket(), u.prefix()),
            (Scheme::S3, "bkt", "a/b")
        );
        assert_eq!(u.to_string(), "s3://bkt/a/b");
        assert_eq!(u.key("x.npy"), "a/b/x.npy");
        let u = StoreUrl::parse("gs://bkt").unwrap();
        assert_eq!((u.scheme(), u.prefix()), (Scheme::Gcs, ""));
        assert_eq!(u.key("x"), "x");
        assert_eq!(u.to_string(), "gs://bkt");
        let u = StoreUrl::parse("AZ://cont//deep//p").unwrap();
        assert_eq!(
            (u.scheme(), u.bucket(), u.prefix()),
            (Scheme::Azure, "cont", "deep/p")
        );
        let u = StoreUrl::parse("file:///data/set/").unwrap();
        assert_eq!(
            (u.scheme(), u.bucket(), u.prefix()),
            (Scheme::File, "/data/set", "")
        );
        assert_eq!(u.to_string(), "file:///data/set");
        let u = StoreUrl::parse("https://host:8443/ds").unwrap();
        assert_eq!(
            (u.scheme(), u.bucket(), u.prefix()),
            (Scheme::Https, "host:8443", "ds")
        );
        assert!(!u.scheme().writable() && Scheme::S3.writable());
    }

    #[test]
    fn bad_urls_name_the_url_and_the_fix() {
        assert!(err("s4://b/p").contains("unsupported scheme `s4`"));
        assert!(err("s4://b/p").contains("s4://b/p"));
        assert!(err("/data/x").contains("no scheme"));
        assert!(err("s3:///p").contains("no bucket; write s3://BUCKET/PREFIX"));
        assert!(err("az://").contains("no container"));
        assert!(err("s3://b/a/../c").contains("segment `..`"));
        assert!(err("s3://b/p?versionId=1").contains("'?' is not allowed"));
        assert!(err("file://rel/dir").contains("absolute path"));
    }

    #[test]
    fn credentials_in_a_url_are_refused_without_being_repeated() {
        for url in [
            "https://user:tok3n@host/ds",
            "s3://key:tok3n@bkt/p",
            "http://tok3n@h:80",
        ] {
            let e = err(url);
            assert!(e.contains("credentials in the URL"), "{e}");
            assert!(e.contains("***@") && !e.contains("tok3n"), "{e}");
        }
        assert!(
            StoreUrl::parse("s3://bkt/a@b").is_ok(),
            "an @ in a key is no userinfo"
        );
        for url in [
            "s3://bucket/dir:v1@x",
            "https://host:8443/a@b",
            "http://[::1]:9000/p@q",
        ] {
            assert!(StoreUrl::parse(url).is_ok(), "{url}: no userinfo");
        }
        let e = err("https://u:p@host/ds@x");
        assert!(
            e.contains("https://***@host/ds@x"),
            "the host stays named: {e}"
        );
        // A query (an Azure SAS token) or a fragment: refused, and not repeated.
        for url in [
            "https://acct.blob.example/c/p?sv=2024&sig=tok3n",
            "az://c/p#sig=tok3n",
        ] {
            let e = err(url);
            assert!(e.contains("is not allowed") && !e.contains("tok3n"), "{e}");
            assert!(e.contains("/c/p?...") || e.contains("/c/p#..."), "{e}");
        }
        assert!(
            err("s3://b/p q").contains("s3://b/p q"),
            "spaces: the URL as given"
        );
        // Before: these three repeated the secret (the scheme check ran before the
        // redaction; the userinfo path put the query back; whitespace printed `s` whole).
        for url in [
            "s3a://AKIAEXAMPLE:tok3n@bkt/ds",
            "ftp://u:tok3n@h/x",
            "https://u:p@host/ds?sig=tok3n",
            "https://host/my ds?sig=tok3n",
            "AKIA:tok3n@bkt/ds",
            // A secret key may hold a `/`: the authority alone missed these.
            "s3://AKIA:wJal/rXtok3n@bkt/ds",
            "https://u:pa/sstok3n@host/ds",
        ] {
            let e = err(url);
            assert!(!e.contains("tok3n"), "{e}");
        }
        assert!(err("https://u:p@host/ds?sig=tok3n").contains("https://***@host/ds?..."));
        assert!(err("s3a://k:tok3n@b/d").contains("unsupported scheme `s3a`"));
    }

    #[test]
    fn an_azure_url_naming_its_account_is_accepted_not_taken_for_credentials() {
        // Before: refused as "credentials in the URL", and echoed as `az://***@myacct...`.
        let u = StoreUrl::parse("az://data@MyAcct.dfs.core.windows.net/ds/v1/").unwrap();
        assert_eq!(
            (u.scheme(), u.bucket(), u.prefix(), u.account()),
            (Scheme::Azure, "data", "ds/v1", Some("myacct"))
        );
        assert_eq!(u.to_string(), "az://data@myacct.dfs.core.windows.net/ds/v1");
        assert_eq!(StoreUrl::parse(&u.to_string()).unwrap(), u);
        let u = StoreUrl::parse("az://data@myacct.blob.core.windows.net").unwrap();
        assert_eq!((u.bucket(), u.prefix()), ("data", ""));
        assert_eq!(u.to_string(), "az://data@myacct.blob.core.windows.net");
        assert_eq!(StoreUrl::parse("az://data/ds").unwrap().account(), None);
        // A secret, another host or another scheme: credentials still, not repeated.
        for url in [
            "az://data:tok3n@myacct.blob.core.windows.net/ds",
            "az://tok3n@example.com/ds",
            "az://Tok3N+x=@myacct.blob.core.windows.net/ds",
            "s3://tok3n@myacct.blob.core.windows.net/ds",
            "https://tok3n@myacct.blob.core.windows.net/ds",
        ] {
            let e = err(url);
            assert!(
                e.contains("credentials in the URL") && !e.contains("tok3n"),
                "{e}"
            );
        }
        let e = err("az://data@my.acct.blob.core.windows.net/ds");
        assert!(
            e.contains("`my.acct` is not a storage account name")
                && e.contains("AZURE_STORAGE_ACCOUNT_NAME=ACCOUNT"),
            "{e}"
        );
        let e = err("az://data@myacct.blob.core.windows.net/ds?sig=tok3n");
        assert!(
            e.contains("'?' is not allowed") && !e.contains("tok3n"),
            "{e}"
        );
    }

    #[test]
    fn a_near_miss_azure_url_says_what_to_write_not_credentials() {
        // Before: "credentials in the URL (`user:secret@`) are not accepted", which sent the
        // user looking for a secret the URL did not hold.
        for url in [
            "az://data@myacct.blob.core.windows.net:443/ds",
            "az://Dat4X@myacct.blob.core.windows.net/ds",
            "az://my_d4ta@myacct.dfs.core.windows.net/ds",
        ] {
            let e = err(url);
            assert!(!e.contains("credentials"), "{url}: {e}");
            assert!(
                e.contains("az://CONTAINER@ACCOUNT.blob.core.windows.net/PREFIX")
                    && e.contains("no port")
                    && e.contains("lowercase letters, digits and `-`"),
                "{url}: {e}"
            );
            // The part before `@` is never repeated.
            assert!(!e.contains("Dat4X") && !e.contains("my_d4ta"), "{e}");
        }
        let e = err("az://Dat4X@acct.blob.core.usgovcloudapi.net/ds");
        assert!(
            e.contains("AZURE_STORAGE_ACCOUNT_NAME=acct")
                && e.contains("AZURE_STORAGE_ENDPOINT=https://acct.blob.core.usgovcloudapi.net")
                && !e.contains("credentials")
                && !e.contains("Dat4X"),
            "{e}"
        );
        let e = err("az://data@acct.dfs.core.chinacloudapi.cn/ds");
        assert!(e.contains("`core.chinacloudapi.cn` cloud"), "{e}");
        // Anything that looks like a secret is still credentials.
        for url in [
            "az://data:tok3n@myacct.blob.core.windows.net:443/ds",
            "az://tok3n+x=@acct.blob.core.usgovcloudapi.net/ds",
            "az://tok3n@example.com:443/ds",
        ] {
            let e = err(url);
            assert!(
                e.contains("credentials in the URL") && !e.contains("tok3n"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_secret_holding_a_query_or_fragment_character_is_never_repeated() {
        // Before: cut at `#`/`?` first, `user:pa` passed as no userinfo, the URL was refused
        // for its fragment instead, and the error read `https://user:pa#...`.
        for url in [
            "https://user:pa#ss@host/ds",
            "https://user:pa?ss@host/ds",
            "s3://AKIAX:se?cret@bkt/ds",
        ] {
            let e = err(url);
            assert!(e.contains("credentials in the URL"), "{e}");
            assert!(!e.contains("user:pa") && !e.contains("AKIAX:se"), "{e}");
            assert!(e.contains("***@"), "{e}");
        }
        assert_eq!(
            redacted("http://u:pa#ss@minio:9000"),
            "http://***@minio:9000"
        );
        assert_eq!(redacted("s3://k:se?c@b/p?x=1"), "s3://***@b/p?...");
        // No scheme of its own, only a URL inside its query: the query goes all the same.
        let signed = "bkt/ds?X-Amz-Signature=S3CRET&r=https://x";
        assert_eq!(redacted(signed), "bkt/ds?...");
        let e = err(signed);
        assert!(!e.contains("S3CRET") && e.contains("no scheme://"), "{e}");
    }

    #[test]
    fn a_cloud_stores_own_endpoint_is_refused_naming_the_url_to_write() {
        // Before: accepted as a WebDAV server, and the listing failed as "(HTTP 405)".
        for (url, fix) in [
            (
                "https://bkt.s3.us-east-1.amazonaws.com/ds",
                "write s3://bkt/ds ",
            ),
            (
                "https://bkt.s3-us-west-2.amazonaws.com/ds",
                "write s3://bkt/ds ",
            ),
            (
                "https://s3.us-east-1.amazonaws.com/bkt/ds/x",
                "write s3://bkt/ds/x ",
            ),
            ("http://my.bkt.s3.amazonaws.com", "write s3://my.bkt "),
            ("https://s3.amazonaws.com/", "write s3://BUCKET/PREFIX "),
            ("https://storage.googleapis.com/bkt/p", "write gs://bkt/p"),
            (
                "https://bkt.storage.googleapis.com/p/q",
                "write gs://bkt/p/q",
            ),
            (
                "https://ACCT.blob.core.windows.net/cont/p",
                "write az://cont/p with AZURE_STORAGE_ACCOUNT_NAME=acct",
            ),
        ] {
            let e = err(url);
            assert!(e.contains(fix) && e.contains("own endpoint"), "{url}: {e}");
        }
        for url in [
            "https://example.com/ds",
            "https://s3-proxy.internal/ds",
            "https://ec2.us-east-1.amazonaws.com/ds",
            "http://127.0.0.1:9000/d",
        ] {
            assert!(StoreUrl::parse(url).is_ok(), "{url}");
        }
    }

    #[test]
    fn a_file_url_is_percent_decoded_and_written_back_escaped() {
        // Before: `my%20set` was taken literally, and a literal space was refused: a
        // directory with a space could not be named.
        let u = StoreUrl::parse("file:///d/my%20set").unwrap();
        assert_eq!(u.bucket(), "/d/my set");
        assert_eq!(u.to_string(), "file:///d/my%20set");
        assert_eq!(StoreUrl::parse(&u.to_string()).unwrap(), u);
        let u = StoreUrl::parse("file:///d/a%25b%3Fc%23d/%C3%A9").unwrap();
        assert_eq!(u.bucket(), "/d/a%b?c#d/\u{e9}");
        assert_eq!(StoreUrl::parse(&u.to_string()).unwrap(), u);
        assert!(err("file:///d/my set").contains("write a space as %20"));
        for bad in [
            "file:///d/100%",
            "file:///d/%zz",
            "file:///d/%+1",
            "file:///d/%00",
        ] {
            assert!(err(bad).contains("write a `%` as %25"), "{bad}");
        }
        assert!(err("file:///d/%FF").contains("no UTF-8"));
        assert!(err("file:///d/%2E%2E/x").contains("segment `..`"));
    }

    #[test]
    fn a_percent_escape_in_an_http_path_is_refused_naming_it() {
        // Before: accepted, asked as `my%2520data`, and the listing came back empty.
        let e = err("https://h/my%20data");
        assert!(
            e.contains("percent-escape") && e.contains("https://h/my%20data"),
            "{e}"
        );
        assert!(
            StoreUrl::parse("s3://b/100%/x").is_ok(),
            "an S3 key is literal"
        );
    }

    #[test]
    fn remote_means_a_known_scheme() {
        for s in [
            "s3://b",
            "gs://b/p",
            "az://c",
            "file:///d",
            "http://h/p",
            "HTTPS://h",
        ] {
            assert!(StoreUrl::is_remote(s), "{s}");
        }
        for s in ["/data/ds", "ds", "./s3/x", "ftp://h/p", "s3:/b"] {
            assert!(!StoreUrl::is_remote(s), "{s}");
        }
    }
}
