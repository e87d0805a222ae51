//! ETags in one form. Azure lists blobs with their ETags unquoted (`0x8D...`) but sends them
//! quoted (`"0x8D..."`) on GET and HEAD, as HTTP writes an entity tag; an ETag pinned from a
//! listing would then never equal the one a read returns, and every read of the dataset
//! would be refused as changed. So every ETag the store hands out, sends (`If-Match`) or
//! compares is in its quoted form.

/// `etag` in its quoted form: a quoted (`"..."`) or weak (`W/"..."`) tag as it is, a bare one
/// quoted.
pub fn quoted_etag(etag: &str) -> String {
    let t = etag.trim();
    if t.starts_with('"') || t.starts_with("W/") {
        t.to_owned()
    } else {
        format!("\"{t}\"")
    }
}

/// The `If-Match` to send for a pinned `etag`: none for a weak tag (`W/"..."`), which
/// `If-Match`'s strong comparison never matches (RFC 9110 §13.1.1: every read would be
/// refused with 412, as if the dataset had changed); the tag of the answer is still compared
/// with it, and the bytes with their CRC-32C.
pub fn if_match(etag: Option<&str>) -> Option<String> {
    etag.filter(|e| !e.trim().starts_with("W/"))
        .map(quoted_etag)
}

/// Whether two ETags name the same version (compared in their quoted forms).
pub fn same_etag(a: &str, b: &str) -> bool {
    quoted_etag(a) == quoted_etag(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listed_azure_etag_equals_the_one_a_read_returns() {
        assert_eq!(quoted_etag("0x8DC2DFC9E520378"), "\"0x8DC2DFC9E520378\"");
        assert!(same_etag("0x8DC2DFC9E520378", "\"0x8DC2DFC9E520378\""));
        // S3 and HTTP tags are quoted already, weak ones kept weak.
        assert_eq!(quoted_etag("\"d41d8cd9\""), "\"d41d8cd9\"");
        assert_eq!(quoted_etag("W/\"abc\""), "W/\"abc\"");
        assert!(
            !same_etag("W/\"abc\"", "\"abc\""),
            "a weak tag is not a strong one"
        );
        assert!(!same_etag("0x1", "\"0x2\""));
    }

    #[test]
    fn a_weak_tag_is_compared_but_never_sent_as_if_match() {
        assert_eq!(if_match(Some("W/\"abc\"")), None);
        assert_eq!(if_match(Some("0x8D")), Some("\"0x8D\"".into()));
        assert_eq!(if_match(Some("\"d41d\"")), Some("\"d41d\"".into()));
        assert_eq!(if_match(None), None);
    }
}
