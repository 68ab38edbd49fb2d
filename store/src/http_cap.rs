//! The HTTP layer under the S3, GCS and Azure backends, with a byte cap on every response.
//!
//! object_store reads some bodies whole by itself, before any of our code sees them: listing
//! pages (XML) and error bodies. A server that answers with an endless page or error body
//! would have it read into memory without end. [`CappedConnector`] wraps object_store's own
//! reqwest client and ends each response body with an error once it passes the cap for its
//! kind (or refuses it at once when its `Content-Length` already does). Object bodies get the
//! largest cap, the largest object the store reads ([`crate::bounded::MAX_MANIFEST_BYTES`]);
//! the store's own reads bound each of them more tightly ([`crate::bounded`]).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use object_store::ClientOptions;
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequest, HttpResponse,
    HttpResponseBody, HttpService, ReqwestConnector,
};

/// One page of a listing: S3 and GCS return at most 1000 keys (about 1 MiB of XML), Azure
/// 5000; 64 MiB is far above either.
pub const MAX_LISTING_PAGE_BYTES: u64 = 64 * 1024 * 1024;
/// An error response's body: a short XML or JSON message.
pub const MAX_ERROR_BODY_BYTES: u64 = 1024 * 1024;
/// Any other response that is not an object's bytes (uploads, deletes, credentials).
pub const MAX_OTHER_BODY_BYTES: u64 = 64 * 1024 * 1024;

/// Why a response was cut off: found in an `object_store::Error`'s source chain and turned
/// into [`crate::Error::ResponseTooLarge`].
#[derive(Debug, thiserror::Error)]
#[error("{what} is over {limit} bytes (at least {got_at_least} came)")]
pub(crate) struct ResponseCapExceeded {
    pub what: String,
    pub limit: u64,
    pub got_at_least: u64,
}

/// The cap in `error`'s source chain, if a response was cut off.
pub(crate) fn cap_exceeded<'e>(
    error: &'e (dyn std::error::Error + 'static),
) -> Option<&'e ResponseCapExceeded> {
    let mut at = Some(error);
    while let Some(e) = at {
        if let Some(found) = e.downcast_ref::<ResponseCapExceeded>() {
            return Some(found);
        }
        at = e.source();
    }
    None
}

/// Builds object_store's reqwest client and caps its responses. Public so that other readers
/// of remote object stores (the operator's bucket sources) get the same bounds.
#[derive(Debug, Default)]
pub struct CappedConnector;

impl HttpConnector for CappedConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        let inner = ReqwestConnector::default().connect(options)?;
        Ok(HttpClient::new(CappedService { inner }))
    }
}

#[derive(Debug)]
struct CappedService {
    inner: HttpClient,
}

/// What a response is, by its request and status, and how large it may be.
fn response_cap(method: &str, path: &str, query: Option<&str>, success: bool) -> (String, u64) {
    // S3 and GCS list with `list-type=2`, Azure with `comp=list`.
    let listing = query.is_some_and(|q| {
        q.split('&')
            .any(|pair| pair.starts_with("list-type=") || pair == "comp=list")
    });
    if !success {
        (
            format!("the error body answering {method} {path}"),
            MAX_ERROR_BODY_BYTES,
        )
    } else if method == "GET" && listing {
        (format!("a listing page of {path}"), MAX_LISTING_PAGE_BYTES)
    } else if method == "GET" {
        (
            format!("the body of GET {path}"),
            crate::bounded::MAX_MANIFEST_BYTES,
        )
    } else {
        (
            format!("the body answering {method} {path}"),
            MAX_OTHER_BODY_BYTES,
        )
    }
}

fn exceeded(what: String, limit: u64, got_at_least: u64) -> HttpError {
    // Decode: object_store does not retry it (a hostile answer would come again).
    HttpError::new(
        HttpErrorKind::Decode,
        ResponseCapExceeded {
            what,
            limit,
            got_at_least,
        },
    )
}

impl HttpService for CappedService {
    // The expansion of `#[async_trait]`, which the trait is declared with.
    fn call<'life0, 'async_trait>(
        &'life0 self,
        req: HttpRequest,
    ) -> Pin<Box<dyn Future<Output = Result<HttpResponse, HttpError>> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(async move {
            let method = req.method().as_str().to_owned();
            // The path only: a query may carry a SAS token.
            let path = req.uri().path().to_owned();
            let query = req.uri().query().map(str::to_owned);
            let response = self.inner.execute(req).await?;
            let (what, limit) = response_cap(
                &method,
                &path,
                query.as_deref(),
                response.status().is_success(),
            );
            cap_response(response, what, limit)
        })
    }
}

/// Caps `response`'s body at `limit` bytes, the error naming `what`: a larger declared length
/// is refused at once, a body that runs past it ends with the error. Public for object-store
/// clients that choose their own caps (the sources' guarded connector).
pub fn cap_response(
    response: HttpResponse,
    what: String,
    limit: u64,
) -> Result<HttpResponse, HttpError> {
    let declared = response
        .headers()
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(declared) = declared.filter(|&d| d > limit) {
        return Err(exceeded(what, limit, declared));
    }
    Ok(response.map(|body| {
        HttpResponseBody::new(CappedBody {
            inner: body,
            seen: 0,
            limit,
            what,
        })
    }))
}

/// A response body that ends with an error once more than `limit` bytes have come.
struct CappedBody {
    inner: HttpResponseBody,
    seen: u64,
    limit: u64,
    what: String,
}

impl Body for CappedBody {
    type Data = Bytes;
    type Error = HttpError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, HttpError>>> {
        let this = self.get_mut();
        if this.seen > this.limit {
            return Poll::Ready(None);
        }
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            this.seen = this.seen.saturating_add(data.len() as u64);
            if this.seen > this.limit {
                return Poll::Ready(Some(Err(exceeded(
                    this.what.clone(),
                    this.limit,
                    this.seen,
                ))));
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_are_capped_by_kind() {
        let cap = |m, q, ok| response_cap(m, "/b", q, ok).1;
        assert_eq!(
            cap("GET", Some("list-type=2&prefix=x"), true),
            MAX_LISTING_PAGE_BYTES
        );
        assert_eq!(
            cap("GET", Some("restype=container&comp=list"), true),
            MAX_LISTING_PAGE_BYTES
        );
        assert_eq!(cap("GET", None, true), crate::bounded::MAX_MANIFEST_BYTES);
        // An Azure SAS token in the query does not make an object GET a listing.
        assert_eq!(
            cap("GET", Some("sv=2022&comp=listx"), true),
            crate::bounded::MAX_MANIFEST_BYTES
        );
        assert_eq!(cap("GET", None, false), MAX_ERROR_BODY_BYTES);
        assert_eq!(cap("PUT", None, true), MAX_OTHER_BODY_BYTES);
    }
}
