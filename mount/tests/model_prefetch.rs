//! Model-aware prefetch (`--prefetch model`) on real FUSE mounts: the first open of a
//! safetensors or GGUF file fetches its tensors before the reader reads them, in ascending
//! offset order, once per file, and leaves the file hydrated; hostile headers are refused,
//! counted, and never change a byte read; files that are not models are left to readahead.
//! The headers are written by hand here.

mod common;

use std::collections::HashSet;
use std::fs::File;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use futures::future::BoxFuture;
use object_store::GetResult;
use object_store::path::Path as ObjectPath;
use sealed_mount::tree::ROOT_INO;
use sealed_mount::{
    MountHandle, MountLimits, MountOptions, NodeCache, NodeCacheOptions, PrefetchSelection,
    ReadaheadPolicy, SealedFs, Tree,
};
use sealed_store::{ChunkStore, Digest, EntryKind, FileEntry, Manifest};
use sealed_test_support::is_chunk;

/// Records the key of every chunk GET of the store it hooks, in the order they arrive.
#[derive(Debug, Default)]
struct Recorder {
    gets: std::sync::Mutex<Vec<String>>,
}

impl Recorder {
    fn chunk_gets(&self) -> Vec<String> {
        self.gets.lock().unwrap().clone()
    }
}

impl GetHook for Recorder {
    fn around_get<'a>(
        &'a self,
        location: &'a ObjectPath,
        get: BoxFuture<'a, object_store::Result<GetResult>>,
    ) -> BoxFuture<'a, object_store::Result<GetResult>> {
        if is_chunk(location) {
            self.gets.lock().unwrap().push(location.to_string());
        }
        get
    }
}

// ---- model files written by hand ---------------------------------------------------------

const MIB: usize = 1 << 20;

/// A safetensors file: the 8-byte header length, `json`, then `data`.
fn safetensors_raw(json: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json.as_bytes());
    out.extend_from_slice(data);
    out
}

/// A valid safetensors file of `tensors` F32 tensors over `data_len` random bytes, listed in
/// the header in reverse offset order (the order loaders read them in is the offsets').
fn safetensors(seed: u64, tensors: usize, data_len: usize) -> Vec<u8> {
    let each = data_len / tensors / 4 * 4;
    let mut entries: Vec<String> = (0..tensors)
        .map(|i| {
            let (begin, end) = (i * each, (i + 1) * each);
            format!(
                r#""layer.{i}.weight": {{"dtype": "F32", "shape": [{}], "data_offsets": [{begin}, {end}]}}"#,
                each / 4
            )
        })
        .collect();
    entries.reverse();
    entries.push(r#""__metadata__": {"format": "pt"}"#.into());
    let json = format!("{{{}}}", entries.join(", "));
    safetensors_raw(&json, &random_bytes(seed, each * tensors))
}

fn gguf_string(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s);
}

/// A GGUF v3 file: metadata (a string, an array of strings, `general.alignment` 64), then
/// `tensors` tensor infos over `data_len` random bytes, the data section aligned.
fn gguf(seed: u64, tensors: usize, data_len: usize) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors as u64).to_le_bytes());
    out.extend_from_slice(&3u64.to_le_bytes());
    gguf_string(&mut out, b"general.architecture");
    out.extend_from_slice(&8u32.to_le_bytes());
    gguf_string(&mut out, b"llama");
    gguf_string(&mut out, b"tokenizer.ggml.tokens");
    out.extend_from_slice(&9u32.to_le_bytes());
    out.extend_from_slice(&8u32.to_le_bytes());
    out.extend_from_slice(&1000u64.to_le_bytes());
    for i in 0..1000 {
        gguf_string(&mut out, format!("tok{i}").as_bytes());
    }
    gguf_string(&mut out, b"general.alignment");
    out.extend_from_slice(&4u32.to_le_bytes());
    out.extend_from_slice(&64u32.to_le_bytes());
    let each = (data_len / tensors) / 64 * 64;
    // Listed in reverse offset order.
    for i in (0..tensors).rev() {
        gguf_string(&mut out, format!("blk.{i}.ffn_up.weight").as_bytes());
        out.extend_from_slice(&2u32.to_le_bytes());
        out.extend_from_slice(&((each / 4 / 16) as u64).to_le_bytes());
        out.extend_from_slice(&16u64.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes()); // F32
        out.extend_from_slice(&((i * each) as u64).to_le_bytes());
    }
    while !out.len().is_multiple_of(64) {
        out.push(0);
    }
    out.extend_from_slice(&random_bytes(seed, each * tensors));
    out
}

/// Files whose headers must be refused (most over several chunks): (name, bytes).
fn hostile_files() -> Vec<(&'static str, Vec<u8>)> {
    let data = |seed| random_bytes(seed, 3 * MIB);
    let with_len = |n: u64, seed| {
        let mut out = n.to_le_bytes().to_vec();
        out.extend_from_slice(&data(seed));
        out
    };
    let mut truncated = gguf(20, 4, 2 * MIB);
    truncated.truncate(5000); // ends inside the token array
    let mut huge_string = b"GGUF".to_vec();
    huge_string.extend_from_slice(&3u32.to_le_bytes());
    huge_string.extend_from_slice(&1u64.to_le_bytes()); // tensors
    huge_string.extend_from_slice(&1u64.to_le_bytes()); // KVs
    gguf_string(&mut huge_string, b"k");
    huge_string.extend_from_slice(&8u32.to_le_bytes());
    huge_string.extend_from_slice(&(1u64 << 60).to_le_bytes());
    huge_string.extend_from_slice(&data(21));
    let mut endless_array = b"GGUF".to_vec();
    endless_array.extend_from_slice(&3u32.to_le_bytes());
    endless_array.extend_from_slice(&0u64.to_le_bytes());
    endless_array.extend_from_slice(&1u64.to_le_bytes());
    gguf_string(&mut endless_array, b"k");
    endless_array.extend_from_slice(&9u32.to_le_bytes());
    endless_array.extend_from_slice(&8u32.to_le_bytes()); // of strings
    endless_array.extend_from_slice(&u64::MAX.to_le_bytes());
    endless_array.extend_from_slice(&vec![0u8; 3 * MIB]); // empty strings, 8 bytes each
    vec![
        ("huge-n.safetensors", with_len(u64::MAX, 10)),
        ("n-beyond-file.safetensors", with_len(4 * MIB as u64, 11)),
        (
            "bad-json.safetensors",
            safetensors_raw(r#"{"a": {"dtype": "F32", "data_off"#, &data(12)),
        ),
        (
            "offsets-beyond.safetensors",
            safetensors_raw(
                r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 99999999]}}"#,
                &data(13),
            ),
        ),
        (
            "begin-after-end.safetensors",
            safetensors_raw(
                r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [800, 400]}}"#,
                &data(14),
            ),
        ),
        (
            "overflow.safetensors",
            safetensors_raw(
                r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 18446744073709551617]}}"#,
                &data(15),
            ),
        ),
        ("truncated.gguf", truncated),
        ("huge-string.gguf", huge_string),
        ("endless-array.gguf", endless_array),
    ]
}

/// The version the tests mount: two good models, the hostile files, and files that are not
/// models.
fn write_tree(root: &Path) {
    let w = |rel: &str, data: &[u8]| {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, data).unwrap();
    };
    w(
        "model-00001-of-00001.safetensors",
        &safetensors(1, 24, 12 * MIB),
    );
    w("gguf/llama-q4.GGUF", &gguf(2, 8, 6 * MIB));
    for (name, bytes) in hostile_files() {
        w(&format!("hostile/{name}"), &bytes);
    }
    w("weights.bin", &random_bytes(3, 16 * MIB));
    w("config.json", br#"{"architectures": ["LlamaForCausalLM"]}"#);
}

// ---- fixture -----------------------------------------------------------------------------

struct Version {
    _tmp: tempfile::TempDir,
    src: std::path::PathBuf,
    recorder: Arc<Recorder>,
    /// The store mounts read through (recording chunk GETs).
    store: ChunkStore,
    digest: Digest,
    manifest: Manifest,
}

impl Version {
    async fn new() -> Version {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        write_tree(&src);
        let plain = file_store(&tmp.path().join("store")).await;
        let digest = push_dir(&plain, &src).await;
        let manifest = plain.get_manifest(&digest).await.unwrap();
        let recorder = Arc::new(Recorder::default());
        let hooked = HookedStore::new(plain.object_store().clone(), recorder.clone());
        let store = ChunkStore::from_object_store(hooked, "recorder");
        Version {
            _tmp: tmp,
            src,
            recorder,
            store,
            digest,
            manifest,
        }
    }

    fn file(&self, rel: &str) -> &FileEntry {
        self.manifest
            .entries
            .iter()
            .find_map(|e| match &e.kind {
                EntryKind::File(f) if e.path == rel => Some(f),
                _ => None,
            })
            .unwrap_or_else(|| panic!("{rel} is in the version"))
    }

    /// The keys of `rel`'s chunks, in file order.
    fn chunk_keys(&self, rel: &str) -> Vec<String> {
        self.file(rel)
            .chunks
            .iter()
            .map(|c| ChunkStore::chunk_key(&c.digest).to_string())
            .collect()
    }

    /// How many of `rel`'s chunks the store was asked for.
    fn fetched(&self, rel: &str) -> usize {
        let gets: HashSet<String> = self.recorder.chunk_gets().into_iter().collect();
        self.chunk_keys(rel)
            .iter()
            .filter(|k| gets.contains(*k))
            .count()
    }
}

/// Daemon readahead off, so that what arrives ahead of the reader is the prefetch's.
fn options(prefetch: &str) -> MountOptions {
    MountOptions {
        prefetch: PrefetchSelection::parse(prefetch).unwrap(),
        readahead: ReadaheadPolicy { initial: 0, max: 0 },
        kernel_readahead_kb: None,
        ..MountOptions::default()
    }
}

fn mount(rt: &tokio::runtime::Runtime, v: &Version, dir: &Path, cache: NodeCache) -> MountHandle {
    rt.block_on(MountHandle::spawn(
        v.store.clone(),
        v.digest,
        dir,
        cache,
        options("model"),
    ))
    .unwrap()
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn ino_of(dir: &Path, rel: &str) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(dir.join(rel)).unwrap().ino()
}

/// Opens `rel` and reads only its safetensors header (8 bytes, then the JSON), as a loader
/// does first; the file stays open.
fn read_safetensors_header(dir: &Path, rel: &str) -> File {
    let mut f = File::open(dir.join(rel)).unwrap();
    let mut len = [0u8; 8];
    f.read_exact(&mut len).unwrap();
    let mut json = vec![0u8; u64::from_le_bytes(len) as usize];
    f.read_exact(&mut json).unwrap();
    let header: serde_json::Value = serde_json::from_slice(&json).unwrap();
    assert!(header.get("__metadata__").is_some(), "{header}");
    f
}

// ---- tests -------------------------------------------------------------------------------

#[test]
fn opening_a_safetensors_file_fetches_its_tensors_before_they_are_read() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let v = rt.block_on(Version::new());
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = disk_cache(cache_dir.path(), 1 << 30);
    let mnt = tempfile::tempdir().unwrap();
    let handle = mount(&rt, &v, mnt.path(), cache.clone());
    let m = mnt.path();
    let rel = "model-00001-of-00001.safetensors";
    let chunks = v.chunk_keys(rel).len();
    assert!(chunks >= 6, "the model spans {chunks} chunks");

    // Only the header is read; a second open (while the first is still open) does not
    // start the prefetch again.
    let f = read_safetensors_header(m, rel);
    let again = File::open(m.join(rel)).unwrap();
    wait_for("every chunk of the model to be fetched", || {
        v.fetched(rel) == chunks
    });
    let metrics = handle.metrics();
    wait_for("the model to be hydrated", || {
        handle.fs().is_hydrated(ino_of(m, rel))
    });
    let s = metrics.snapshot();
    assert_eq!(s.model_prefetch_files, 1, "{s:?}");
    assert_eq!(s.model_header_failures, 0, "{s:?}");
    assert!(
        s.model_prefetch_chunks as usize >= chunks / 2,
        "the prefetch fetched the tensors' chunks, not the reader: {s:?}"
    );
    // Each chunk was asked of the store once: the reader and the prefetch share flights.
    let gets = v.recorder.chunk_gets();
    let mine: Vec<&String> = gets
        .iter()
        .filter(|k| v.chunk_keys(rel).contains(k))
        .collect();
    assert_eq!(mine.len(), chunks, "{mine:?}");

    // Everything reads back exact, without asking the store again.
    drop((f, again));
    let before = v.recorder.chunk_gets().len();
    let want = std::fs::read(v.src.join(rel)).unwrap();
    assert!(std::fs::read(m.join(rel)).unwrap() == want);
    assert_eq!(v.recorder.chunk_gets().len(), before);
    // Opened again later: nothing starts again.
    drop(File::open(m.join(rel)).unwrap());
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(metrics.snapshot().model_prefetch_files, 1);
    rt.block_on(handle.unmount()).unwrap();
}

#[test]
fn a_gguf_file_is_prefetched_and_hydrated() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let v = rt.block_on(Version::new());
    let cache_dir = tempfile::tempdir().unwrap();
    let mnt = tempfile::tempdir().unwrap();
    let handle = mount(&rt, &v, mnt.path(), disk_cache(cache_dir.path(), 1 << 30));
    let m = mnt.path();
    let rel = "gguf/llama-q4.GGUF";
    let chunks = v.chunk_keys(rel).len();
    assert!(chunks >= 3, "the model spans {chunks} chunks");
    let mut f = File::open(m.join(rel)).unwrap();
    let mut magic = [0u8; 4];
    f.read_exact(&mut magic).unwrap();
    assert_eq!(&magic, b"GGUF");
    wait_for("every chunk of the GGUF file", || v.fetched(rel) == chunks);
    wait_for("the GGUF file to be hydrated", || {
        handle.fs().is_hydrated(ino_of(m, rel))
    });
    let s = handle.metrics().snapshot();
    assert_eq!(
        (s.model_prefetch_files, s.model_header_failures),
        (1, 0),
        "{s:?}"
    );
    drop(f);
    assert!(std::fs::read(m.join(rel)).unwrap() == std::fs::read(v.src.join(rel)).unwrap());
    rt.block_on(handle.unmount()).unwrap();
}

#[test]
fn hostile_headers_are_refused_counted_and_read_back_exact() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let v = rt.block_on(Version::new());
    let cache_dir = tempfile::tempdir().unwrap();
    let mnt = tempfile::tempdir().unwrap();
    let handle = mount(&rt, &v, mnt.path(), disk_cache(cache_dir.path(), 1 << 30));
    let m = mnt.path();
    let hostile = hostile_files();
    // All opened at once; each is refused and prefetched in plain order instead.
    let files: Vec<File> = hostile
        .iter()
        .map(|(name, _)| File::open(m.join("hostile").join(name)).unwrap())
        .collect();
    wait_for("every hostile header to be refused", || {
        handle.metrics().snapshot().model_header_failures == hostile.len() as u64
    });
    for (name, _) in &hostile {
        let rel = format!("hostile/{name}");
        let chunks = v.chunk_keys(&rel).len();
        wait_for(&format!("{rel} to be prefetched in order"), || {
            v.fetched(&rel) == chunks
        });
    }
    for (name, bytes) in &hostile {
        let got = std::fs::read(m.join("hostile").join(name)).unwrap();
        assert!(got == *bytes, "{name} reads back exact");
    }
    drop(files);
    let s = handle.metrics().snapshot();
    assert_eq!(s.model_prefetch_files, hostile.len() as u64, "{s:?}");
    assert_eq!(s.read_errors, 0, "{s:?}");
    rt.block_on(handle.unmount()).unwrap();
}

#[test]
fn files_that_are_not_models_are_not_prefetched() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let v = rt.block_on(Version::new());
    let cache_dir = tempfile::tempdir().unwrap();
    let mnt = tempfile::tempdir().unwrap();
    let handle = mount(&rt, &v, mnt.path(), disk_cache(cache_dir.path(), 1 << 30));
    let m = mnt.path();
    let rel = "weights.bin";
    let chunks = v.chunk_keys(rel).len();
    assert!(chunks >= 8, "{chunks}");
    let mut f = File::open(m.join(rel)).unwrap();
    let mut head = vec![0u8; 4096];
    f.read_exact(&mut head).unwrap();
    assert_eq!(
        std::fs::read(m.join("config.json")).unwrap(),
        std::fs::read(v.src.join("config.json")).unwrap()
    );
    std::thread::sleep(Duration::from_millis(500));
    // The kernel reads ahead up to 1 MiB of its own; nothing more arrives.
    let fetched = v.fetched(rel);
    assert!(
        fetched <= chunks / 2,
        "{fetched} of {chunks} chunks fetched"
    );
    let s = handle.metrics().snapshot();
    assert_eq!(
        (s.model_prefetch_files, s.model_prefetch_chunks),
        (0, 0),
        "{s:?}"
    );
    drop(f);
    rt.block_on(handle.unmount()).unwrap();
}

#[test]
fn without_model_in_the_selection_nothing_is_prefetched_on_open() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let v = rt.block_on(Version::new());
    let cache_dir = tempfile::tempdir().unwrap();
    let mnt = tempfile::tempdir().unwrap();
    let handle = rt
        .block_on(MountHandle::spawn(
            v.store.clone(),
            v.digest,
            mnt.path(),
            disk_cache(cache_dir.path(), 1 << 30),
            options("*.json"),
        ))
        .unwrap();
    let rel = "model-00001-of-00001.safetensors";
    let f = read_safetensors_header(mnt.path(), rel);
    std::thread::sleep(Duration::from_millis(500));
    let (fetched, chunks) = (v.fetched(rel), v.chunk_keys(rel).len());
    assert!(fetched <= chunks / 2, "{fetched} of {chunks}");
    assert_eq!(handle.metrics().snapshot().model_prefetch_files, 0);
    // A later selection adds to the running mount: `model` applies to the next first open.
    assert!(handle.add_prefetch(&PrefetchSelection::parse("model").unwrap()));
    assert!(!handle.add_prefetch(&PrefetchSelection::parse("model,*.json").unwrap()));
    drop(f);
    let _f = File::open(mnt.path().join(rel)).unwrap();
    wait_for("the model to be prefetched after `model` was added", || {
        v.fetched(rel) == chunks
    });
    rt.block_on(handle.unmount()).unwrap();
}

/// Through the read API (no kernel, so no kernel readahead), one fetch at a time: the store
/// sees the header's chunks, then the tensors' in ascending offset order, though the header
/// lists them in reverse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tensors_are_fetched_in_ascending_offset_order() {
    let v = Version::new().await;
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = disk_cache(cache_dir.path(), 1 << 30);
    let tree = Tree::build(v.manifest.clone()).unwrap();
    let fs = Arc::new(
        SealedFs::new(
            v.digest,
            tree,
            v.store.clone(),
            cache.clone(),
            ReadaheadPolicy::default(),
        )
        .with_limits(&MountLimits {
            max_fetches_per_read: 1,
            ..MountLimits::default()
        }),
    );
    fs.set_model_prefetch(true);
    for rel in ["model-00001-of-00001.safetensors", "gguf/llama-q4.GGUF"] {
        let mut ino = ROOT_INO;
        for part in rel.split('/') {
            ino = fs.lookup(ino, part.as_bytes()).unwrap().ino;
        }
        let before = v.recorder.chunk_gets().len();
        let fh = fs.open(ino, false).unwrap();
        sealed_mount::prefetch::on_open(&fs, ino);
        sealed_mount::prefetch::on_open(&fs, ino);
        let keys = v.chunk_keys(rel);
        let start = Instant::now();
        while v.recorder.chunk_gets().len() < before + keys.len() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{rel} prefetched"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let gets = v.recorder.chunk_gets()[before..].to_vec();
        assert_eq!(gets, keys, "{rel}: every chunk once, in offset order");
        fs.release(fh);
    }
}

/// Without a disk tier the chunks would land in the bounded memory tier, where a whole file
/// fetched ahead would push itself out before the loader reads it: only the header and the
/// first readahead window of tensor data are fetched, and the file still reads back exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_disk_tier_only_the_first_window_is_prefetched() {
    let v = Version::new().await;
    let cache = NodeCache::new(&NodeCacheOptions::default()).unwrap();
    let tree = Tree::build(v.manifest.clone()).unwrap();
    let window = 2 << 20;
    let fs = Arc::new(SealedFs::new(
        v.digest,
        tree,
        v.store.clone(),
        cache,
        ReadaheadPolicy {
            initial: 1 << 20,
            max: window,
        },
    ));
    fs.set_model_prefetch(true);
    let rel = "model-00001-of-00001.safetensors";
    let ino = fs.lookup(ROOT_INO, rel.as_bytes()).map(|a| a.ino).unwrap();
    let fh = fs.open(ino, false).unwrap();
    sealed_mount::prefetch::on_open(&fs, ino);
    // Until the fetches stop (bounded: with the prefetch broken the file is never counted).
    let started = Instant::now();
    let mut last = (usize::MAX, Instant::now());
    loop {
        let now = v.fetched(rel);
        if now != last.0 {
            last = (now, Instant::now());
        } else if last.1.elapsed() > Duration::from_millis(500)
            && fs.metrics().snapshot().model_prefetch_files == 1
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the model prefetch did not run in 60 s: {} chunks fetched, {:?}",
            now,
            fs.metrics().snapshot().model_prefetch_files
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let file = v.file(rel);
    let covering = {
        // Chunks starting before the end of the header's first read (1 MiB) or the window.
        let mut start = 0u64;
        let mut n = 0;
        for c in &file.chunks {
            if start < (1 << 20).max(window + 8) {
                n += 1;
            }
            start += u64::from(c.len);
        }
        n
    };
    let fetched = v.fetched(rel);
    assert!(
        fetched <= covering + 1 && fetched < file.chunks.len(),
        "{fetched} of {} chunks fetched, {covering} in the first window",
        file.chunks.len()
    );
    let mut got = Vec::new();
    loop {
        let data = fs
            .read(ino, Some(fh), got.len() as u64, 1 << 20)
            .await
            .unwrap();
        if data.is_empty() {
            break;
        }
        got.extend_from_slice(&data);
    }
    assert!(got == std::fs::read(v.src.join(rel)).unwrap());
    fs.release(fh);
}
