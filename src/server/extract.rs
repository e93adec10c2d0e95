//! JSON and raw-body extractors whose rejections use our error shape (axum's answer plain
//! text).

use axum::extract::{FromRequest, Request};
use axum::RequestExt;
use bytes::BytesMut;
use http_body_util::BodyExt;
use serde::de::DeserializeOwned;

use super::errors::ApiError;

pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let axum::Json(v) = axum::Json::<T>::from_request(req, state).await?;
        Ok(ApiJson(v))
    }
}

/// A raw body, read frame by frame into one buffer of the announced `content-length` (a
/// weight bucket of hundreds of megabytes is neither held twice, as its frames and then their
/// copy, nor faulted in page by page: the buffer asks for huge pages). Rejections, e.g. over
/// the route's size limit (413), use our error shape.
pub struct ApiBytes(pub axum::body::Bytes);

/// The largest announced length read into a buffer sized up front; a longer body grows one.
const PRESIZED_MAX: usize = 4 << 30;

impl<S: Send + Sync> FromRequest<S> for ApiBytes {
    type Rejection = ApiError;

    async fn from_request(req: Request, _: &S) -> Result<Self, Self::Rejection> {
        let announced = req
            .headers()
            .get(axum::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
            .filter(|&n| n <= PRESIZED_MAX)
            .unwrap_or(0);
        // The route's DefaultBodyLimit ends the body with an error past the limit.
        let mut body = req.into_limited_body();
        let mut buf = BytesMut::with_capacity(announced);
        advise_huge_pages(&buf);
        while let Some(frame) = body.frame().await {
            match frame.map_err(rejection)?.into_data() {
                Ok(data) => buf.extend_from_slice(&data),
                Err(_) => break, // trailers: the data is over
            }
        }
        Ok(ApiBytes(buf.freeze()))
    }
}

/// A body's read error: past the size limit (axum wraps the limit's error twice), or another.
fn rejection(e: axum::Error) -> ApiError {
    let mut err: axum::BoxError = e.into();
    loop {
        match err.downcast::<axum::Error>() {
            Ok(wrapped) => err = wrapped.into_inner(),
            Err(other) => {
                err = other;
                break;
            }
        }
    }
    if err.is::<http_body_util::LengthLimitError>() {
        ApiError::PayloadTooLarge
    } else {
        ApiError::Invalid {
            param: None,
            message: format!("Failed to buffer the request body: {err}"),
        }
    }
}

/// Asks for transparent huge pages over a large buffer's whole pages (Linux; a hint): one
/// fault per 2 MiB instead of per 4 KiB as the body is written into it.
fn advise_huge_pages(buf: &BytesMut) {
    #[cfg(target_os = "linux")]
    if buf.capacity() >= 4 << 20 {
        const PAGE: usize = 4096;
        let start = (buf.as_ptr() as usize).next_multiple_of(PAGE);
        let end = (buf.as_ptr() as usize + buf.capacity()) / PAGE * PAGE;
        // SAFETY: whole pages inside this buffer's allocation; MADV_HUGEPAGE changes how
        // they are backed, never their contents.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::extract::DefaultBodyLimit;
    use axum::http::StatusCode;
    use axum::response::IntoResponse;
    use axum::routing::put;
    use axum::Router;
    use tower::ServiceExt;

    async fn echo_len(ApiBytes(body): ApiBytes) -> String {
        format!(
            "{} {}",
            body.len(),
            body.iter().map(|&b| b as usize).sum::<usize>()
        )
    }

    async fn call(r: &Router, body: Body) -> (StatusCode, String) {
        let resp = r
            .clone()
            .oneshot(axum::http::Request::put("/").body(body).unwrap())
            .await
            .unwrap()
            .into_response();
        let status = resp.status();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Bodies with and without a length (a stream of frames) arrive whole, large ones
    /// included; past the route's limit the answer is 413 in our error shape.
    #[tokio::test]
    async fn raw_bodies_arrive_whole_and_over_the_limit_are_refused() {
        let big = 6 << 20;
        let r = Router::new()
            .route("/", put(echo_len))
            .layer(DefaultBodyLimit::max(big));
        let data: Vec<u8> = (0..big).map(|i| (i % 251) as u8).collect();
        let sum: usize = data.iter().map(|&b| b as usize).sum();
        let (status, text) = call(&r, Body::from(data.clone())).await;
        assert_eq!((status, text), (StatusCode::OK, format!("{big} {sum}")));

        let frames: Vec<Result<bytes::Bytes, std::io::Error>> = data
            .chunks(1 << 20)
            .map(|c| Ok(bytes::Bytes::copy_from_slice(c)))
            .collect();
        let streamed = Body::from_stream(futures_util::stream::iter(frames));
        let (status, text) = call(&r, streamed).await;
        assert_eq!((status, text), (StatusCode::OK, format!("{big} {sum}")));

        let (status, text) = call(&r, Body::from(vec![1u8; big + 1])).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{text}");
        assert!(text.contains("error"), "our error shape: {text}");
    }
}
