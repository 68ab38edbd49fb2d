//! Bounds on what a source may send: a listing is counted (entries, bytes, pages) as it
//! arrives, a response body is read only up to what it can legitimately be, and a file only
//! up to the size its listing declared. A server that sends more (an endless tree listing, an
//! endless error page, a file past its size) fails the sync with `SourceTooLarge` or a
//! protocol error that names the bound, after at most that many bytes.

use futures::StreamExt;

/// Most entries one listing may have (files and directories over all pages): a repository
/// or prefix with more is refused rather than held in memory.
pub const MAX_LISTING_ENTRIES: u64 = 500_000;
/// Most bytes of listing over all pages (about 500 bytes an entry at the entry limit).
pub const MAX_LISTING_BYTES: u64 = 256 << 20;
/// Most bytes of one listing page (the Hub's pages hold 1000 entries, ~300 KB).
pub const MAX_PAGE_BYTES: u64 = 16 << 20;
/// Most pages of one listing.
pub const MAX_LISTING_PAGES: u64 = 10_000;
/// Most bytes of a small JSON answer (the Hub's revision info).
pub const MAX_METADATA_BYTES: u64 = 1 << 20;
/// Bytes of an error answer's body read for its message; the rest is never read.
pub const MAX_ERROR_BODY_BYTES: u64 = 4 << 10;

/// The bounds of one sync's listing; [`Default`] is the constants above.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SourceLimits {
    /// Entries over all pages ([`MAX_LISTING_ENTRIES`]).
    pub max_entries: u64,
    /// Bytes over all pages ([`MAX_LISTING_BYTES`]).
    pub max_listing_bytes: u64,
    /// Bytes of one page ([`MAX_PAGE_BYTES`]).
    pub max_page_bytes: u64,
    /// Pages ([`MAX_LISTING_PAGES`]).
    pub max_pages: u64,
}

impl Default for SourceLimits {
    fn default() -> Self {
        SourceLimits {
            max_entries: MAX_LISTING_ENTRIES,
            max_listing_bytes: MAX_LISTING_BYTES,
            max_page_bytes: MAX_PAGE_BYTES,
            max_pages: MAX_LISTING_PAGES,
        }
    }
}

/// What a listing has used of its [`SourceLimits`] so far. Each method returns the
/// message of the bound it passed.
#[derive(Debug)]
pub(crate) struct ListingBudget {
    limits: SourceLimits,
    entries: u64,
    bytes: u64,
    pages: u64,
}

impl ListingBudget {
    pub fn new(limits: SourceLimits) -> Self {
        ListingBudget {
            limits,
            entries: 0,
            bytes: 0,
            pages: 0,
        }
    }

    /// One more page is about to be requested.
    pub fn page(&mut self) -> Result<(), String> {
        self.pages = self.pages.saturating_add(1);
        if self.pages > self.limits.max_pages {
            return Err(format!(
                "the listing has more than {} pages, the most a sync follows",
                self.limits.max_pages
            ));
        }
        Ok(())
    }

    /// The bytes a page may still have: the page bound or what is left of the total.
    pub fn page_cap(&self) -> u64 {
        self.limits
            .max_page_bytes
            .min(self.limits.max_listing_bytes.saturating_sub(self.bytes))
    }

    /// `n` entries of `bytes` bytes more.
    pub fn add(&mut self, n: u64, bytes: u64) -> Result<(), String> {
        self.entries = self.entries.saturating_add(n);
        self.bytes = self.bytes.saturating_add(bytes);
        if self.entries > self.limits.max_entries {
            return Err(format!(
                "the listing has more than {} entries, the most a sync lists; sync a smaller \
                 prefix or repository",
                self.limits.max_entries
            ));
        }
        if self.bytes > self.limits.max_listing_bytes {
            return Err(self.bytes_exceeded());
        }
        Ok(())
    }

    /// The message for a page that passed [`page_cap`](Self::page_cap).
    pub fn page_exceeded(&self) -> String {
        if self.page_cap() < self.limits.max_page_bytes {
            self.bytes_exceeded()
        } else {
            format!(
                "a listing page is larger than {} bytes, the most a page may be",
                self.limits.max_page_bytes
            )
        }
    }

    fn bytes_exceeded(&self) -> String {
        format!(
            "the listing is larger than {} bytes, the most a sync reads",
            self.limits.max_listing_bytes
        )
    }
}

/// Why a bounded body could not be read.
#[derive(Debug)]
pub(crate) enum BodyError {
    /// More than the cap arrived (or the Content-Length said so).
    TooLarge,
    /// The transfer failed.
    Http(reqwest::Error),
}

/// The whole body of `resp`, or [`BodyError::TooLarge`] as soon as it passes `cap` bytes
/// (before reading any of it when its Content-Length says so). Reads at most `cap` + one
/// network read.
pub(crate) async fn read_capped(resp: reqwest::Response, cap: u64) -> Result<Vec<u8>, BodyError> {
    if resp.content_length().is_some_and(|n| n > cap) {
        return Err(BodyError::TooLarge);
    }
    let mut body = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(piece) = stream.next().await {
        let piece = piece.map_err(BodyError::Http)?;
        if (body.len() as u64).saturating_add(piece.len() as u64) > cap {
            return Err(BodyError::TooLarge);
        }
        body.extend_from_slice(&piece);
    }
    Ok(body)
}

/// The first `cap` bytes of the body of `resp` as text (lossy), for an error message; the
/// rest is never read (the connection is dropped).
pub(crate) async fn read_prefix(resp: reqwest::Response, cap: u64) -> String {
    let cap = usize::try_from(cap).unwrap_or(usize::MAX);
    let mut body = Vec::new();
    let mut stream = resp.bytes_stream();
    while body.len() < cap {
        match stream.next().await {
            Some(Ok(piece)) => {
                let take = piece.len().min(cap - body.len());
                body.extend_from_slice(&piece[..take]);
            }
            _ => break,
        }
    }
    String::from_utf8_lossy(&body).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_counts_over_pages() {
        let mut b = ListingBudget::new(SourceLimits {
            max_entries: 10,
            max_listing_bytes: 100,
            max_page_bytes: 60,
            max_pages: 3,
        });
        assert_eq!(b.page_cap(), 60);
        b.page().unwrap();
        b.add(6, 50).unwrap();
        // What is left of the total caps the next page.
        assert_eq!(b.page_cap(), 50);
        assert!(b.page_exceeded().contains("larger than 100 bytes"));
        b.page().unwrap();
        let e = b.add(5, 10).unwrap_err();
        assert!(e.contains("more than 10 entries"), "{e}");
        b.page().unwrap();
        let e = b.page().unwrap_err();
        assert!(e.contains("more than 3 pages"), "{e}");
        let mut b = ListingBudget::new(SourceLimits::default());
        assert!(b.page_exceeded().contains(&MAX_PAGE_BYTES.to_string()));
        let e = b.add(1, MAX_LISTING_BYTES + 1).unwrap_err();
        assert!(e.contains(&MAX_LISTING_BYTES.to_string()), "{e}");
    }
}
