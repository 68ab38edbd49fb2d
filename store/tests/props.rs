//! Property tests: manifest encoding round-trips; chunks always tile the input exactly.

use proptest::prelude::*;
use sealed_store::chunker::{ChunkParams, chunk_reader, cut_points};
use sealed_store::{ChunkRef, Digest, Entry, EntryKind, FileEntry, Manifest};

fn small_params() -> ChunkParams {
    ChunkParams {
        min_size: 1024,
        avg_size: 4096,
        max_size: 16384,
        ..ChunkParams::default()
    }
}

/// A valid manifest: a random set of paths with every parent present as a directory.
fn arb_manifest() -> impl Strategy<Value = Manifest> {
    let name = prop_oneof![
        Just("a".to_string()),
        Just("b".into()),
        Just("é".into()),
        Just("x.safetensors".into()),
        Just("日本".into())
    ];
    let path = prop::collection::vec(name, 1..4).prop_map(|c| c.join("/"));
    let kind = prop_oneof![
        Just(0u8),
        (
            any::<bool>(),
            prop::collection::vec((any::<[u8; 32]>(), 1u32..=4096), 0..5)
        )
            .prop_map(|_| 1u8),
        Just(2u8),
    ];
    let file = (
        any::<bool>(),
        any::<[u8; 32]>(),
        prop::collection::vec((any::<[u8; 32]>(), 1u32..=4 << 20), 0..5),
    );
    prop::collection::btree_map(path, (kind, file), 0..20).prop_map(|paths| {
        let mut entries: std::collections::BTreeMap<String, EntryKind> = Default::default();
        for (path, (kind, (exec, blake, chunks))) in paths {
            let mut parent = String::new();
            for comp in path.split('/').collect::<Vec<_>>().split_last().unwrap().1 {
                parent = if parent.is_empty() {
                    comp.to_string()
                } else {
                    format!("{parent}/{comp}")
                };
                entries.insert(parent.clone(), EntryKind::Dir);
            }
            if matches!(entries.get(&path), Some(EntryKind::Dir)) {
                continue;
            }
            let k = match kind {
                0 => EntryKind::Dir,
                1 => {
                    let chunks: Vec<ChunkRef> = chunks
                        .into_iter()
                        .map(|(d, len)| ChunkRef {
                            digest: Digest::from_bytes(d),
                            len,
                        })
                        .collect();
                    EntryKind::File(FileEntry {
                        executable: exec,
                        size: chunks.iter().map(|c| u64::from(c.len)).sum(),
                        blake3: Digest::from_bytes(blake),
                        chunks,
                    })
                }
                // A name no entry has: a dangling link. (A link to "b" could be "b" itself
                // or lead back to itself through "a/b", a loop the format refuses.)
                _ => EntryKind::Symlink {
                    target: "target.bin".into(),
                },
            };
            entries.insert(path, k);
        }
        // A path used as a parent must be a directory.
        let dirs: Vec<String> = entries
            .keys()
            .filter_map(|p| p.rsplit_once('/').map(|(d, _)| d.to_string()))
            .collect();
        for d in dirs {
            entries.insert(d, EntryKind::Dir);
        }
        let mut entries: Vec<Entry> = entries
            .into_iter()
            .map(|(path, kind)| Entry { path, kind })
            .collect();
        entries.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
        Manifest {
            chunking: ChunkParams::default(),
            entries,
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn manifest_encode_parse_round_trip(m in arb_manifest()) {
        let bytes = m.encode().unwrap();
        let back = Manifest::parse(&bytes).unwrap();
        prop_assert_eq!(&back, &m);
        prop_assert_eq!(back.encode().unwrap(), bytes);
    }

    #[test]
    fn parse_never_panics_on_garbage(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = Manifest::parse(&bytes);
    }

    #[test]
    fn chunks_tile_the_input(data in prop::collection::vec(any::<u8>(), 0..200_000), zeros in 0usize..50_000) {
        let mut data = data;
        data.extend(std::iter::repeat_n(0u8, zeros));
        let params = small_params();
        let content = chunk_reader(&data[..], &params, &|_| {}).unwrap();
        let mut pos = 0usize;
        for c in &content.chunks {
            let end = pos + c.len as usize;
            prop_assert!(end <= data.len());
            prop_assert!(c.len as usize <= 16384);
            prop_assert_eq!(Digest::of(&data[pos..end]), c.digest);
            pos = end;
        }
        prop_assert_eq!(pos, data.len());
        prop_assert_eq!(content.size, data.len() as u64);
        prop_assert_eq!(content.blake3, Digest::of(&data));
        let mut end = 0;
        let ends: Vec<usize> = content.chunks.iter().map(|c| { end += c.len as usize; end }).collect();
        prop_assert_eq!(ends, cut_points(&data, &params));
    }
}
