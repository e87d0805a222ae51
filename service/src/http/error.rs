//! The one error type of the HTTP fronts, and the one check of the admin token. Every error
//! is `{"code", "message"}` with the status its [`ErrorCode`] maps to.

use axum::Json;
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
        .and_then(|v| v.strip_prefix("Bearer "));
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
