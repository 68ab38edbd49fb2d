//! Prefetch: fetching chunks before readers ask (`--prefetch none|model|all|GLOBS`).
//!
//! - **Background** (`all`, globs): after mounting, every chunk of the selected files goes into
//!   the node disk cache, `prefetch_concurrency` at a time ([`prefetch`]).
//! - **Model-aware** (`model`): on the first open of a `*.safetensors` or `*.gguf` file, its
//!   header is read through the mount's own read path, parsed (`crate::model_header`), and
//!   the chunks holding its tensors are fetched in offset order, many at once, so that a loader
//!   reading the tensors (or faulting a mapping of them in) finds them local instead of waiting
//!   on a readahead window that starts cold at every seek ([`ModelPrefetch`]). Once per file per
//!   mount; a complete file is then assembled for passthrough (`crate::hydrate`).
//!
//! Both share the single-flight table with readers, so a reader that gets to a chunk first
//! never causes a second fetch, and neither changes what a read returns: every byte is still
//! verified chunk by chunk. What a header says only decides the order of fetches.

use std::sync::Arc;

use futures::StreamExt;
use globset::{Glob, GlobSet, GlobSetBuilder};
use sealed_store::{ChunkRef, FileEntry};
use tokio::sync::OwnedSemaphorePermit;

use crate::error::{FetchError, FsError, MountError};
use crate::fetch::Want;
use crate::fs::SealedFs;
use crate::metrics::MountMetrics;
use crate::model_header::{self, HeaderError, ModelFormat, ModelLayout};

/// What to prefetch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PrefetchSelection {
    #[default]
    None,
    /// Every file, in the background after mounting.
    All,
    /// Files whose path (relative to the root) or name matches any of these globs, in the
    /// background after mounting.
    Globs(Vec<String>),
    /// Model-aware prefetch on the first open of each model file; `globs` (may be empty) are
    /// prefetched in the background as with [`PrefetchSelection::Globs`] (`model,*.json`).
    Model { globs: Vec<String> },
}

/// The keyword that turns on model-aware prefetch in a selection.
pub const MODEL_KEYWORD: &str = "model";

impl PrefetchSelection {
    /// Parses `none`, `all`, `model`, comma-separated globs (`*.safetensors,tokenizer*`), or
    /// `model` among globs (`model,*.json`). `none` and `all` stand alone.
    pub fn parse(text: &str) -> Result<PrefetchSelection, MountError> {
        let words: Vec<String> = text
            .split(',')
            .map(|g| g.trim().to_owned())
            .filter(|g| !g.is_empty())
            .collect();
        let alone = |word: &str| MountError::BadPattern {
            pattern: text.trim().to_owned(),
            reason: format!(
                "'{word}' stands alone (only '{MODEL_KEYWORD}' combines with globs, as in \
                 'model,*.json')"
            ),
        };
        let mut model = false;
        let mut globs = Vec::new();
        for word in &words {
            match word.as_str() {
                "none" | "all" if words.len() > 1 => return Err(alone(word)),
                "none" => return Ok(PrefetchSelection::None),
                "all" => return Ok(PrefetchSelection::All),
                MODEL_KEYWORD => model = true,
                glob => globs.push(glob.to_owned()),
            }
        }
        if !globs.is_empty() {
            build(&globs)?;
        }
        Ok(match (model, globs.is_empty()) {
            (true, _) => PrefetchSelection::Model { globs },
            (false, true) => PrefetchSelection::None,
            (false, false) => PrefetchSelection::Globs(globs),
        })
    }

    /// True if model files get the model-aware prefetch when opened.
    pub fn model(&self) -> bool {
        matches!(self, PrefetchSelection::Model { .. })
    }

    /// True if there is anything to prefetch in the background after mounting.
    pub fn background(&self) -> bool {
        match self {
            PrefetchSelection::None => false,
            PrefetchSelection::All => true,
            PrefetchSelection::Globs(globs) | PrefetchSelection::Model { globs } => {
                !globs.is_empty()
            }
        }
    }
}

fn build(globs: &[String]) -> Result<GlobSet, MountError> {
    let mut set = GlobSetBuilder::new();
    for g in globs {
        let glob = Glob::new(g).map_err(|e| MountError::BadPattern {
            pattern: g.clone(),
            reason: e.to_string(),
        })?;
        set.add(glob);
    }
    set.build().map_err(|e| MountError::BadPattern {
        pattern: globs.join(","),
        reason: e.to_string(),
    })
}

/// What a background prefetch did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchReport {
    pub files: u64,
    pub chunks: u64,
    pub bytes: u64,
    pub failed_chunks: u64,
}

/// Fetches every chunk of the files `selection` prefetches in the background into the cache,
/// `concurrency` at a time (nothing for `none`, nor for `model` without globs).
pub async fn prefetch(
    fs: Arc<SealedFs>,
    selection: &PrefetchSelection,
    concurrency: usize,
) -> Result<PrefetchReport, MountError> {
    let matcher = match selection {
        PrefetchSelection::None => return Ok(PrefetchReport::default()),
        PrefetchSelection::Model { globs } if globs.is_empty() => {
            return Ok(PrefetchReport::default());
        }
        PrefetchSelection::All => None,
        PrefetchSelection::Globs(globs) | PrefetchSelection::Model { globs } => Some(build(globs)?),
    };
    let mut report = PrefetchReport::default();
    let mut chunks: Vec<ChunkRef> = Vec::new();
    let mut files: Vec<FileEntry> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (ino, file) in fs.tree().files() {
        if let Some(m) = &matcher {
            let path = fs.tree().path(ino).unwrap_or_default();
            let name = path.rsplit('/').next().unwrap_or_default();
            if !m.is_match(&path) && !m.is_match(name) {
                continue;
            }
        }
        report.files += 1;
        files.push(file.clone());
        for c in &file.chunks {
            if seen.insert(c.digest) {
                chunks.push(*c);
            }
        }
    }
    let results: Vec<_> = futures::stream::iter(chunks)
        .map(|c| {
            let fs = fs.clone();
            async move { (c, fs.cache().prefetch(fs.store(), &c).await) }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    fs.cache().flush().await;
    // Complete files are assembled for passthrough (`crate::hydrate`).
    for file in &files {
        if let Err(e) = crate::hydrate::assemble(fs.cache(), fs.store(), file).await {
            tracing::warn!(blake3 = %file.blake3, error = %e, "assembling a prefetched file failed");
        }
    }
    for (c, r) in results {
        match r {
            Ok(()) => {
                report.chunks += 1;
                report.bytes += u64::from(c.len);
            }
            Err(e) => {
                report.failed_chunks += 1;
                tracing::warn!(error = %e, "background prefetch of a chunk failed");
            }
        }
    }
    Ok(report)
}

// ---- model-aware prefetch ----------------------------------------------------------------

/// Bytes of a model file read first; a header that needs more is read on (4× at a time).
const FIRST_HEADER_READ: u64 = 1 << 20;
/// Largest single read of a header through the read path.
const HEADER_READ_PIECE: u64 = 8 << 20;
/// File `ino` of `fs` was opened (after [`SealedFs::open`]; the FUSE adapter calls this):
/// under `model`, the first open of a model file starts its prefetch in the background.
/// Needs a tokio runtime context.
pub fn on_open(fs: &Arc<SealedFs>, ino: u64) {
    let model = fs.model_prefetch();
    if !model.enabled() {
        return;
    }
    let Some(file) = fs.file_entry(ino) else {
        return;
    };
    let Some(path) = fs.tree().path(ino) else {
        return;
    };
    let Some(format) = ModelFormat::of_name(path.rsplit('/').next().unwrap_or_default()) else {
        return;
    };
    if file.size == 0 || fs.is_hydrated(ino) {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    if !model.files.lock().insert(ino) {
        // Running or done: a second open does not start it again.
        return;
    }
    let fs2 = fs.clone();
    let task = runtime.spawn(async move {
        let done = run(&fs2, ino, format).await;
        if !done {
            fs2.model_prefetch().files.lock().remove(&ino);
        }
    });
    let mut tasks = model.tasks.lock();
    tasks.retain(|t| !t.is_finished());
    tasks.push(task.abort_handle());
}

/// Why no layout came of a header.
enum LayoutError {
    /// The header is not one we accept: the file is prefetched in plain order instead.
    Refused(String),
    /// The header could not be read (the store failed): nothing is prefetched now.
    Read(FsError),
}

/// The model prefetch of file `ino`: true when it ran to the end (every chunk fetched, or
/// nothing to do), false when a read or a fetch failed and a later open should try again.
async fn run(fs: &Arc<SealedFs>, ino: u64, format: ModelFormat) -> bool {
    let Some((file, starts)) = fs.file_layout(ino) else {
        return true;
    };
    let path = fs.tree().path(ino).unwrap_or_default();
    let metrics = fs.metrics();
    let layout = match read_layout(fs, ino, format, file.size).await {
        Ok(layout) => Some(layout),
        Err(LayoutError::Refused(reason)) => {
            MountMetrics::inc(&metrics.model_header_failures);
            tracing::warn!(
                path,
                format = format.name(),
                reason,
                "model header refused: prefetching the file in plain order instead"
            );
            None
        }
        Err(LayoutError::Read(e)) => {
            tracing::warn!(path, error = %e, "reading a model header failed: no prefetch now");
            return false;
        }
    };
    let mut order = chunk_order(starts, layout.as_ref());
    if fs.cache().disk().is_none() {
        // Without a disk tier the chunks land in the bounded memory tier, where chunks
        // fetched far ahead of the loader would push each other out before it reads them:
        // only the first readahead window of tensor data is fetched; readahead does the rest.
        let header_len = layout.as_ref().map_or(0, |l| l.header_len);
        let until = header_len.saturating_add(fs.readahead_policy().max);
        order.retain(|&i| starts.get(i).is_some_and(|&s| s < until));
    }
    MountMetrics::inc(&metrics.model_prefetch_files);
    let per_file = fs.fetches_per_read();
    let results: Vec<Result<bool, FetchError>> = futures::stream::iter(order)
        .map(|i| {
            let chunk = file.chunks[i];
            async move { fetch_ahead(fs, chunk).await }
        })
        .buffered(per_file)
        .collect()
        .await;
    let mut failed = 0u64;
    for result in results {
        match result {
            Ok(true) => MountMetrics::inc(&metrics.model_prefetch_chunks),
            Ok(false) => {}
            Err(e) => {
                failed += 1;
                tracing::debug!(path, error = %e, "model prefetch of a chunk failed");
            }
        }
    }
    if failed > 0 {
        tracing::warn!(
            path,
            failed,
            "model prefetch: some chunks failed (readers retry them)"
        );
        return false;
    }
    if let Some(layout) = &layout {
        tracing::debug!(
            path,
            format = format.name(),
            tensors = layout.tensors.len(),
            header_bytes = layout.header_len,
            "model prefetch done"
        );
    }
    if fs.cache().disk().is_some() {
        // The whole file is local now: assembled for passthrough, as a background prefetch's.
        fs.cache().flush().await;
        if let Err(e) = crate::hydrate::assemble(fs.cache(), fs.store(), file).await {
            tracing::warn!(path, error = %e, "assembling a model-prefetched file failed");
        }
    }
    true
}

/// The layout of a model file, its header read through the mount's read path (so that the
/// loader's own read of it finds the chunks in memory), never more than
/// [`model_header::header_limit`] bytes of it, and with the mount's header memory bounded.
async fn read_layout(
    fs: &SealedFs,
    ino: u64,
    format: ModelFormat,
    size: u64,
) -> Result<ModelLayout, LayoutError> {
    let limit = model_header::header_limit(size);
    let mut have: Vec<u8> = Vec::new();
    let mut want = FIRST_HEADER_READ.min(limit);
    let mut held: Option<OwnedSemaphorePermit> = None;
    loop {
        // Permits for `want` bytes (rounded up to MiB) before reading them.
        let mib = usize::try_from(want.div_ceil(1 << 20)).unwrap_or(usize::MAX);
        let more = mib.saturating_sub(held.as_ref().map_or(0, |p| p.num_permits()));
        if more > 0 {
            let permit = fs
                .model_prefetch()
                .header_memory
                .clone()
                .acquire_many_owned(u32::try_from(more).unwrap_or(u32::MAX))
                .await
                .map_err(|_| LayoutError::Refused("the mount is ending".into()))?;
            match &mut held {
                Some(h) => h.merge(permit),
                None => held = Some(permit),
            }
        }
        while (have.len() as u64) < want {
            let from = have.len() as u64;
            let piece = (want - from).min(HEADER_READ_PIECE) as u32;
            let data = fs
                .read_for_prefetch(ino, from, piece)
                .await
                .map_err(LayoutError::Read)?;
            if data.is_empty() {
                break;
            }
            have.extend_from_slice(&data);
        }
        match model_header::parse(format, &have, size) {
            Ok(layout) => return Ok(layout),
            Err(HeaderError::NeedMore(n)) if n > have.len() as u64 && n <= limit => {
                want = n.max(want.saturating_mul(4)).min(limit);
            }
            Err(HeaderError::NeedMore(n)) => {
                return Err(LayoutError::Refused(format!(
                    "the header needs {n} bytes; {} could be read",
                    have.len()
                )));
            }
            Err(HeaderError::Bad(reason)) => return Err(LayoutError::Refused(reason)),
        }
    }
}

/// The chunks of a file in the order the model prefetch fetches them: the header's, then
/// those holding tensors in ascending offset order, then any the tensors leave out (padding,
/// trailing bytes), so that the whole file ends up local. Without a layout, every chunk in
/// order. Indices into the file's chunk list; `starts` are the chunk offsets and the size.
pub(crate) fn chunk_order(starts: &[u64], layout: Option<&ModelLayout>) -> Vec<usize> {
    let chunks = starts.len().saturating_sub(1);
    let Some(layout) = layout else {
        return (0..chunks).collect();
    };
    let mut taken = vec![false; chunks];
    let mut order = Vec::with_capacity(chunks);
    let mut take = |range: std::ops::Range<usize>, order: &mut Vec<usize>| {
        for i in range {
            if let Some(t) = taken.get_mut(i)
                && !*t
            {
                *t = true;
                order.push(i);
            }
        }
    };
    take(
        crate::tree::chunk_range(starts, 0, layout.header_len),
        &mut order,
    );
    for tensor in &layout.tensors {
        take(
            crate::tree::chunk_range(starts, tensor.start, tensor.end),
            &mut order,
        );
    }
    take(0..chunks, &mut order);
    order
}

/// Makes sure one chunk is local ahead of readers: skipped if it is on disk, in memory or in
/// flight; else fetched (onto disk, or into memory without a disk tier) holding a model slot
/// and a fetch slot of the mount. True if it was fetched.
pub(crate) async fn fetch_ahead(fs: &SealedFs, chunk: ChunkRef) -> Result<bool, FetchError> {
    let cache = fs.cache();
    if cache.is_local_or_coming(&chunk.digest) {
        return Ok(false);
    }
    let closed = || FetchError::Internal {
        digest: chunk.digest,
        reason: "the mount's fetch slots are closed".into(),
    };
    let model_slot = fs
        .model_prefetch()
        .slots
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| closed())?;
    let slot = fs
        .fetch_slots()
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| closed())?;
    // A reader may have fetched it while this waited.
    if cache.is_local_or_coming(&chunk.digest) {
        return Ok(false);
    }
    // Into memory only without a disk tier (`Want::Prefetch`). Counted in the mount's cold
    // start by the tier that answers, as a read's fetch is.
    let flight = cache.flight(
        fs.store(),
        &chunk,
        Want::Prefetch,
        Some(slot),
        Some(fs.cold_start().clone()),
    );
    flight.await?;
    drop(model_slot);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selections_parse() {
        use PrefetchSelection as P;
        assert_eq!(P::parse("").unwrap(), P::None);
        assert_eq!(P::parse(" none ").unwrap(), P::None);
        assert_eq!(P::parse("all").unwrap(), P::All);
        assert_eq!(P::parse("model").unwrap(), P::Model { globs: vec![] });
        assert_eq!(
            P::parse("model, *.json,tokenizer*").unwrap(),
            P::Model {
                globs: vec!["*.json".into(), "tokenizer*".into()]
            }
        );
        assert_eq!(
            P::parse("*.json,model").unwrap(),
            P::Model {
                globs: vec!["*.json".into()]
            }
        );
        assert_eq!(
            P::parse("*.safetensors,config.json").unwrap(),
            P::Globs(vec!["*.safetensors".into(), "config.json".into()])
        );
        for bad in ["all,model", "none,*.json", "model,all", "["] {
            assert!(P::parse(bad).is_err(), "{bad}");
        }
        let e = P::parse("all,*.json").unwrap_err().to_string();
        assert!(e.contains("stands alone"), "{e}");
        assert!(P::parse("model").unwrap().model());
        assert!(!P::parse("model").unwrap().background());
        assert!(P::parse("model,*.json").unwrap().background());
        assert!(!P::parse("all").unwrap().model());
    }

    #[test]
    fn chunks_in_tensor_order_then_the_rest() {
        // Chunks at 0, 10, 20, 30, 40; file of 50 bytes.
        let starts = [0, 10, 20, 30, 40, 50];
        assert_eq!(chunk_order(&starts, None), vec![0, 1, 2, 3, 4]);
        let layout = ModelLayout {
            header_len: 5,
            tensors: vec![5..12, 30..35, 35..50],
        };
        // Header chunk 0, tensors over 0-1 and 3-4, then chunk 2 (padding nobody lists).
        assert_eq!(chunk_order(&starts, Some(&layout)), vec![0, 1, 3, 4, 2]);
        let empty: [u64; 1] = [0];
        assert_eq!(chunk_order(&empty, Some(&layout)), Vec::<usize>::new());
    }
}
