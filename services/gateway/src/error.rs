//! The gateway's errors as OpenAI's API returns them: a status and OpenAI's error body, made
//! from a request the gateway refuses or from an error class of the protocol.

use actix_web::http::StatusCode;
use llmq_protocol::{ErrorClass, WireError};
use serde_json::{json, Value};

/// An error on its way to the client: status and OpenAI's body.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub code: &'static str,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            code: "invalid_request",
        }
    }

    pub fn from_wire(e: &WireError) -> Self {
        let (status, code) = match e.class {
            ErrorClass::InvalidRequest => (StatusCode::BAD_REQUEST, "invalid_request"),
            ErrorClass::UnknownModel => (StatusCode::NOT_FOUND, "model_not_found"),
            ErrorClass::PromptTooLong => (StatusCode::PAYLOAD_TOO_LARGE, "context_length_exceeded"),
            ErrorClass::NeverFits => (StatusCode::PAYLOAD_TOO_LARGE, "never_fits"),
            ErrorClass::QueueFull => (StatusCode::TOO_MANY_REQUESTS, "queue_full"),
            ErrorClass::NoWorker => (StatusCode::SERVICE_UNAVAILABLE, "no_worker"),
            ErrorClass::WorkerLost => (StatusCode::SERVICE_UNAVAILABLE, "worker_lost"),
            ErrorClass::ConstraintFailed => {
                (StatusCode::INTERNAL_SERVER_ERROR, "constraint_failed")
            }
            ErrorClass::Cancelled => (StatusCode::INTERNAL_SERVER_ERROR, "cancelled"),
            ErrorClass::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal_error"),
        };
        ApiError {
            status,
            message: e.message.clone(),
            code,
        }
    }

    pub fn unauthorized() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "a valid API key is required: Authorization: Bearer <key>".into(),
            code: "invalid_api_key",
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            code: "unavailable",
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            code: "internal_error",
        }
    }

    /// OpenAI's error object.
    pub fn body(&self) -> Value {
        let kind = match self.status.as_u16() {
            400 | 401 | 404 | 413 => "invalid_request_error",
            429 => "rate_limit_error",
            _ => "server_error",
        };
        json!({ "error": { "message": self.message, "type": kind, "param": null, "code": self.code } })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.message)
    }
}

impl actix_web::ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }
    fn error_response(&self) -> actix_web::HttpResponse {
        actix_web::HttpResponse::build(self.status).json(self.body())
    }
}
