//! A file that changes while it is being pushed fails the push; nothing is sealed.

mod support;

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use sealed_store::push::{PushOptions, push};
use sealed_store::{Error, NoProgress};
use support::*;

#[tokio::test]
async fn a_file_growing_during_push_fails_it() {
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src");
    std::fs::create_dir(&src).unwrap();
    let file = src.join("growing.log");
    std::fs::write(&file, pseudo_random(64 << 20, 9)).unwrap();
    let store = file_store(&work.path().join("store")).await;

    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (stop, file) = (stop.clone(), file.clone());
        std::thread::spawn(move || {
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(&file)
                .unwrap();
            while !stop.load(Ordering::Relaxed) {
                f.write_all(b"more log lines\n").unwrap();
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        })
    };
    let result = push(&store, &src, &PushOptions::default(), Arc::new(NoProgress)).await;
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();

    match result {
        Err(Error::FileChanged { path, .. }) => assert_eq!(path, file),
        other => panic!("expected FileChanged, got {other:?}"),
    }
    assert!(
        store.list_versions().await.unwrap().is_empty(),
        "a manifest was sealed"
    );
}
