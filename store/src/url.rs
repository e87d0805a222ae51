//! [`StoreUrl`]: a dataset location in object storage (`s3://bucket/prefix`, `gs://`, `az://`,
//! `file:///dir`, `http(s)://host/path`), parsed with errors that name the URL and the fix.

use crate::error::StoreError;

/// The storage service a URL names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// `s3://BUCKET/PREFIX`: Amazon S3 or an S3-compatible store (`AWS_ENDPOINT_URL`).
    S3,
    /// `gs://BUCKET/PREFIX`: Google Cloud Storage.
    Gcs,
    /// `az://CONTAINER/PREFIX`: Azure Blob Storage (account from `AZURE_STORAGE_ACCOUNT_NAME`).
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
/// directory) and prefix (`/`-separated, no leading or trailing `/`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StoreUrl {
    scheme: Scheme,
    bucket: String,
    prefix: String,
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
        let shown = redacted(s);
        let bad = |reason: String| StoreError::Url {
            url: shown.clone(),
            reason,
        };
        let Some((name, rest)) = s.split_once("://") else {
            return Err(bad(format!("not a URL (no scheme://); {SCHEMES_HINT}")));
        };
        let scheme = Scheme::of(name)
            .ok_or_else(|| bad(format!("unsupported scheme `{name}`; {SCHEMES_HINT}")))?;
        let before_query = rest.split(['?', '#']).next().unwrap_or("");
        if userinfo_end(before_query).is_some() {
            return Err(bad(
                "credentials in the URL (`user:secret@`) are not accepted: they \
                            would show in logs, errors and metrics; give them in the \
                            environment (docs/CONFIGURATION.md, object storage)"
                    .into(),
            ));
        }
        if let Some(c) = rest
            .chars()
            .find(|c| matches!(c, '?' | '#') || c.is_whitespace())
        {
            let note = if c.is_whitespace() {
                ""
            } else {
                "; what follows it is not repeated here (it may be a signature): give \
                 credentials in the environment (docs/CONFIGURATION.md, object storage)"
            };
            return Err(bad(format!(
                "{c:?} is not allowed in a dataset URL (no query, fragment or spaces){note}"
            )));
        }
        if matches!(scheme, Scheme::Http | Scheme::Https) && rest.contains('%') {
            // The client escapes the path itself: `my%20data` would be asked as
            // `my%2520data`, a path the server does not have (an empty listing).
            return Err(bad(
                "a percent-escape (`%`) is not supported in an http(s) dataset \
                            path: serve the dataset under a path of plain characters"
                    .into(),
            ));
        }
        if scheme == Scheme::File {
            return Self::parse_file(rest).map_err(bad);
        }
        let (bucket, path) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            let what = match scheme {
                Scheme::Azure => "container",
                Scheme::Http | Scheme::Https => "host",
                _ => "bucket",
            };
            return Err(bad(format!(
                "no {what}; write {}://{}/PREFIX",
                scheme.as_str(),
                what.to_uppercase()
            )));
        }
        let named = matches!(scheme, Scheme::S3 | Scheme::Gcs | Scheme::Azure);
        if named && let Some(c) = bucket.chars().find(|c| host_char(*c)) {
            // `s3://minio:9000/bkt/ds`: a server's address where the bucket goes.
            return Err(bad(format!(
                "`{bucket}` is not a bucket name ({c:?} marks a server's address); a server's \
                 address goes in the environment (AWS_ENDPOINT_URL=http://HOST:PORT for MinIO \
                 or another S3 server), the URL names the bucket: s3://BUCKET/PREFIX"
            )));
        }
        let prefix = clean_prefix(path).map_err(bad)?;
        Ok(StoreUrl {
            scheme,
            bucket: bucket.to_owned(),
            prefix,
        })
    }

    /// `file:///abs/dir`: the bucket is the directory, the prefix empty.
    fn parse_file(rest: &str) -> Result<StoreUrl, String> {
        let path = match rest.strip_prefix("localhost") {
            Some(p) => p,
            None => rest,
        };
        if !path.starts_with('/') {
            return Err("a file URL needs an absolute path: file:///DIR".into());
        }
        let clean = clean_prefix(path)?;
        Ok(StoreUrl {
            scheme: Scheme::File,
            bucket: format!("/{clean}"),
            prefix: String::new(),
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

    /// The full key of `key` (relative to the prefix) inside the bucket.
    pub fn key(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_owned()
        } else {
            format!("{}/{key}", self.prefix)
        }
    }
}

/// `s` as an error may repeat it: a userinfo (`user:secret@`) becomes `***@`, and a query
/// or fragment (a SAS token, a presigned URL's signature) becomes `?...` (`#...`).
pub(crate) fn redacted(s: &str) -> String {
    let (head, tail) = match s.find(['?', '#']) {
        Some(at) => (&s[..at], &s[at..at + 1]),
        None => (s, ""),
    };
    let (scheme, rest) = match head.split_once("://") {
        Some((name, rest)) => (format!("{name}://"), rest),
        None => (String::new(), head),
    };
    let rest = match userinfo_end(rest) {
        Some(at) => format!("***@{}", &rest[at + 1..]),
        None => rest.to_owned(),
    };
    let dots = if tail.is_empty() { "" } else { "..." };
    format!("{scheme}{rest}{tail}{dots}")
}

/// Where the userinfo of `rest` (a URL after `scheme://`, before any query) ends: the last
/// `@` of its first segment (`user:secret@host`); or, when that segment holds a `:` that is
/// not a numeric port's (`key:se/cret@bucket/...`: an AWS secret key may hold a `/`), the
/// first `@` after it. An `@` in a key (`bkt/dir:v1@x`) or after a port (`h:8443/a@b`,
/// `[::1]:9000/p@q`) is none.
fn userinfo_end(rest: &str) -> Option<usize> {
    let end = rest.find('/').unwrap_or(rest.len());
    let first = &rest[..end];
    if let Some(at) = first.rfind('@') {
        return Some(at);
    }
    // An IPv6 host's own colons are inside its brackets.
    let host = first.rsplit_once(']').map_or(first, |(_, after)| after);
    let (_, after) = host.split_once(':')?;
    let port = !after.is_empty() && after.bytes().all(|b| b.is_ascii_digit());
    if port {
        return None;
    }
    rest[end..].find('@').map(|i| end + i)
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
        match self.scheme {
            Scheme::File => write!(f, "file://{}", self.bucket),
            s if self.prefix.is_empty() => write!(f, "{}://{}", s.as_str(), self.bucket),
            s => write!(f, "{}://{}/{}", s.as_str(), self.bucket, self.prefix),
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
