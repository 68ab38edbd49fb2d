//! The registration socket against hostile HTTP/2, with the real binary: HPACK lets a small
//! header block decode to gigabytes (one big header in the dynamic table, then 1-byte indexed
//! fields naming it again), and before the header-list bound one 1 MB frame of that took the
//! plugin down (out of memory). Each attack must end only its own connection: the plugin
//! stays up and still answers kubelet on a new one.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{Plugin, connect, store_with_version};
use sealed_csi::authority::{
    CONTINUATION, END_HEADERS, HEADERS, PREFACE, encode_integer, encode_string, write_frame,
};
use sealed_csi::proto::pluginregistration::InfoRequest;
use sealed_csi::proto::pluginregistration::registration_client::RegistrationClient;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    write_frame(&mut out, kind, flags, stream, payload);
    out
}

/// A table size update to 64 KiB (what the decoder allows), a 60 KiB header added to the
/// dynamic table, then `len` bytes in all of 1-byte fields naming it again.
fn amplifying_block(len: usize) -> Vec<u8> {
    let mut block = Vec::new();
    encode_integer(&mut block, 0x20, 5, 64 * 1024);
    block.push(0x40);
    encode_string(&mut block, b"x-a");
    encode_string(&mut block, &[b'v'; 60 * 1024]);
    let refs = len.saturating_sub(block.len());
    block.extend(std::iter::repeat_n(0x80 | 62, refs));
    block
}

async fn registration_socket(plugin: &Plugin, kubelet: &Path) -> PathBuf {
    let socket = kubelet.join("plugins_registry/csi.sealedvolumes.io-reg.sock");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        assert!(
            Instant::now() < deadline,
            "no registration socket; log:\n{}",
            plugin.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    socket
}

/// Sends `attack` on a fresh connection and waits for the plugin to end it (EOF or reset),
/// at most 20 s: a plugin that decodes it all never ends it in time.
async fn send_and_wait_for_close(socket: &Path, attack: &[u8]) {
    let mut stream = tokio::net::UnixStream::connect(socket).await.unwrap();
    // The plugin may close while we are still writing: that is the point.
    let _ = stream.write_all(attack).await;
    let mut buf = vec![0u8; 64 * 1024];
    let closed = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "the plugin kept the hostile connection open"
    );
}

async fn still_answers(socket: &Path, plugin: &Plugin) {
    let mut client = RegistrationClient::new(connect(socket).await);
    let info = client
        .get_info(InfoRequest {})
        .await
        .unwrap_or_else(|e| panic!("no answer after the attack: {e}; log:\n{}", plugin.log()))
        .into_inner();
    assert_eq!(info.name, "csi.sealedvolumes.io");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hpack_bombs_end_their_connection_not_the_plugin() {
    let store = store_with_version("registration_bounds").await;
    let kubelet = tempfile::tempdir().unwrap();
    let kubelet_dir = format!("--kubelet-dir={}", kubelet.path().display());
    let plugin = Plugin::start(&store.url, &[&kubelet_dir]);
    let socket = registration_socket(&plugin, kubelet.path()).await;
    still_answers(&socket, &plugin).await;

    // What the audit sent: one 1 MB HEADERS frame (≈ 60 GB once decoded).
    let mut attack = PREFACE.to_vec();
    attack.extend(frame(0x4, 0, 0, &[]));
    attack.extend(frame(HEADERS, END_HEADERS, 1, &amplifying_block(1 << 20)));
    send_and_wait_for_close(&socket, &attack).await;
    still_answers(&socket, &plugin).await;

    // The same bomb in legal frame sizes: HEADERS + CONTINUATIONs of 16 KiB, 64 KiB in all
    // (≈ 0.3 GB once decoded, from a block within the compressed-block bound).
    let block = amplifying_block(64 * 1024);
    let mut attack = PREFACE.to_vec();
    attack.extend(frame(0x4, 0, 0, &[]));
    let pieces: Vec<&[u8]> = block.chunks(16_384).collect();
    for (i, piece) in pieces.iter().enumerate() {
        let kind = if i == 0 { HEADERS } else { CONTINUATION };
        let flags = if i + 1 == pieces.len() {
            END_HEADERS
        } else {
            0
        };
        attack.extend(frame(kind, flags, 1, piece));
    }
    send_and_wait_for_close(&socket, &attack).await;
    still_answers(&socket, &plugin).await;

    let log = plugin.log();
    assert!(!log.contains("panicked"), "{log}");
}
