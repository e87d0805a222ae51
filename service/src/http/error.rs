//! The one error type of the HTTP fronts, and the one check of the admin token. Every error
//! is `{"code", "message"}` with the status its [`ErrorCode`] maps to.

use axum::Json;
use axum::extract::rejection::PathRejection;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use shardwire_node::{ControlError, Node, OpenError};
use shardwire_protocol::trainer::ErrorCode;
use shardwire_protocol::trainer::http::ErrorBody;

/// An API error: its code, the message, and the status (the code's, unless overridden).
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: ErrorCode,
    message: String,
}

impl ApiError {
    /// An error whose status follows from its code.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        let status = StatusCode::from_u16(code.http_status()).expect("a valid status");
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    /// A malformed request.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::BadRequest, message)
    }

    /// The same error with another status (e.g. 413 for a body over the limit).
    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = Json(ErrorBody {
            code: self.code,
            message: self.message,
        });
        (self.status, body).into_response()
    }
}

impl From<OpenError> for ApiError {
    fn from(e: OpenError) -> Self {
        Self::new(e.code, e.message)
    }
}

impl From<ControlError> for ApiError {
    fn from(e: ControlError) -> Self {
        Self::new(e.code(), e.to_string())
    }
}

/// The JSON error of a path whose parameters do not decode (`%FF` is not UTF-8): routes take
/// `Result<Path<_>, PathRejection>` and map the rejection here, since axum's own is text/plain.
pub fn path_error(e: PathRejection) -> ApiError {
    ApiError::bad_request(format!("bad path: {}", e.body_text()))
}

/// The credentials of an `Authorization` value in the `Bearer` scheme. Scheme names are
/// case-insensitive (RFC 7235 section 2.1), so `bearer tok` is as good as `Bearer tok`.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(token)
}

/// Checks `Authorization: Bearer <token>` for mutating endpoints (constant-time compare);
/// each refusal is counted by reason.
pub fn authorize(node: &Node, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(token) = &node.info().admin_token else {
        return Err(ApiError::new(
            ErrorCode::AdminDisabled,
            "mutating admin endpoints are disabled: no admin_token_file is configured",
        ));
    };
    let given = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token);
    match given {
        None => {
            metrics::counter!("shardwire_admin_auth_fails_total", "reason" => "missing")
                .increment(1);
            Err(ApiError::new(
                ErrorCode::Unauthorized,
                "missing `Authorization: Bearer <token>`",
            ))
        }
        Some(g) if shardwire_protocol::auth::ct_eq(g.trim().as_bytes(), token) => Ok(()),
        Some(_) => {
            metrics::counter!("shardwire_admin_auth_fails_total", "reason" => "wrong").increment(1);
            Err(ApiError::new(ErrorCode::Forbidden, "wrong admin token"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_is_matched_in_any_case() {
        // Before: only `Bearer ` was taken, so `bearer tok` read as a missing token.
        for ok in ["Bearer tok", "bearer tok", "BEARER tok", "bEaReR tok"] {
            assert_eq!(bearer_token(ok), Some("tok"), "{ok}");
        }
        for bad in ["Basic tok", "Bearertok", "Bearer", "", "Bearers tok"] {
            assert_eq!(bearer_token(bad), None, "{bad}");
        }
    }
}
