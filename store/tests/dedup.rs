//! Dedup: a re-push uploads nothing; a checkpoint with ~10% changed uploads little more than
//! the changed bytes.

mod support;

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;

use support::*;

#[tokio::test]
async fn scattered_overwrites_upload_about_the_changed_bytes() {
    const GIB: usize = 1 << 30;
    const REGION: usize = 8 << 20;
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("ckpt");
    std::fs::create_dir(&src).unwrap();
    let file = src.join("model.safetensors");
    std::fs::write(&file, pseudo_random(GIB, 42)).unwrap();
    let store = file_store(&work.path().join("store")).await;

    let first = push_dir(&store, &src).await;
    assert_eq!(first.bytes_uploaded, GIB as u64);

    // Overwrite 13 of the 128 8-MiB regions (~10%), spread over the file, at odd offsets.
    let f = OpenOptions::new().write(true).open(&file).unwrap();
    let mut changed = 0u64;
    for i in 0..13u64 {
        let offset = i * 10 * REGION as u64 + 3 * REGION as u64 + 12_345;
        f.write_all_at(&pseudo_random(REGION, 1000 + i), offset)
            .unwrap();
        changed += REGION as u64;
    }
    drop(f);

    let second = push_dir(&store, &src).await;
    assert_ne!(second.digest, first.digest);
    let ratio = second.bytes_uploaded as f64 / changed as f64;
    eprintln!(
        "changed {changed} bytes, uploaded {} ({ratio:.3}x), reused {}",
        second.bytes_uploaded, second.bytes_reused
    );
    assert!(
        second.bytes_uploaded >= changed,
        "uploaded less than changed: lost data?"
    );
    assert!(ratio <= 1.25, "uploaded {ratio:.3}x the changed bytes");

    // And the same tree pushed a third time uploads nothing.
    let third = push_dir(&store, &src).await;
    assert_eq!(third.digest, second.digest);
    assert_eq!(third.bytes_uploaded, 0);
}
