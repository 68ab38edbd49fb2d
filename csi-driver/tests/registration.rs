//! kubelet plugin registration against the real binary: with `--kubelet-dir` it serves
//! `pluginregistration.Registration` on `<kubelet-dir>/plugins_registry/csi.sealedvolumes.io-reg.sock`
//! and points kubelet at its CSI socket; the socket goes away when the plugin stops.

mod common;

use common::{Plugin, connect, store_with_version};
use sealed_csi::proto::pluginregistration::registration_client::RegistrationClient;
use sealed_csi::proto::pluginregistration::{InfoRequest, RegistrationStatus};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_with_kubelet_through_the_plugins_registry() {
    let store = store_with_version("registers_with_kubelet").await;
    let kubelet = tempfile::tempdir().unwrap();
    let kubelet_dir = format!("--kubelet-dir={}", kubelet.path().display());
    let plugin = Plugin::start(
        &store.url,
        &[
            &kubelet_dir,
            "--kubelet-registration-path=/var/lib/kubelet/plugins/csi.sealedvolumes.io/csi.sock",
        ],
    );
    let socket = kubelet
        .path()
        .join("plugins_registry/csi.sealedvolumes.io-reg.sock");
    // The registration server starts with the CSI one; give it a moment.
    for _ in 0..100 {
        if socket.exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        socket.exists(),
        "no registration socket; log:\n{}",
        plugin.log()
    );
    let mut client = RegistrationClient::new(connect(&socket).await);
    let info = client.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.r#type, "CSIPlugin");
    assert_eq!(info.name, "csi.sealedvolumes.io");
    assert_eq!(
        info.endpoint,
        "/var/lib/kubelet/plugins/csi.sealedvolumes.io/csi.sock"
    );
    assert_eq!(info.supported_versions, vec!["1.0.0".to_string()]);
    client
        .notify_registration_status(RegistrationStatus {
            plugin_registered: false,
            error: "test refusal".into(),
        })
        .await
        .unwrap();
    client
        .notify_registration_status(RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .unwrap();
    let log = plugin.log();
    assert!(log.contains("test refusal"), "{log}");
    assert!(log.contains("registered with kubelet"), "{log}");
    drop(client);
    drop(plugin);
    assert!(
        !socket.exists(),
        "the registration socket outlived the plugin"
    );
}

/// What kubelet 1.34's plugin watcher sends: grpc-go dialling the socket path, so the
/// `:authority` is the %-encoded path, which h2 alone refuses with `RST_STREAM PROTOCOL_ERROR`.
/// Played here with raw HTTP/2 frames (no Rust client can send that authority) against the
/// real binary; the answer must be the plugin info with `grpc-status: 0`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_a_client_that_sends_the_socket_path_as_authority() {
    use prost::Message as _;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    let store = store_with_version("registration_authority").await;
    let kubelet = tempfile::tempdir().unwrap();
    let kubelet_dir = format!("--kubelet-dir={}", kubelet.path().display());
    let plugin = Plugin::start(&store.url, &[&kubelet_dir]);
    let socket = kubelet
        .path()
        .join("plugins_registry/csi.sealedvolumes.io-reg.sock");
    for _ in 0..100 {
        if socket.exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let authority = socket
        .display()
        .to_string()
        .replace('/', "%2F")
        .into_bytes();
    let mut encoder = loona_hpack::Encoder::new();
    let headers = encoder.encode(vec![
        (&b":method"[..], &b"POST"[..]),
        (b":scheme", b"http"),
        (b":path", b"/pluginregistration.Registration/GetInfo"),
        (b":authority", &authority[..]),
        (b"content-type", b"application/grpc"),
        (b"user-agent", b"grpc-go/1.72.1"),
        (b"te", b"trailers"),
    ]);
    let mut request = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    request.extend(frame(0x4, 0, 0, &[]));
    request.extend(frame(0x1, 0x4, 1, &headers));
    // An empty InfoRequest: uncompressed, length 0.
    request.extend(frame(0x0, 0x1, 1, &[0, 0, 0, 0, 0]));
    let mut conn = tokio::net::UnixStream::connect(&socket).await.unwrap();
    conn.write_all(&request).await.unwrap();

    let mut decoder = loona_hpack::Decoder::new();
    let mut received = Vec::new();
    let mut data = Vec::new();
    let mut trailers = None;
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while trailers.is_none() {
        let mut buf = [0u8; 4096];
        let n = tokio::time::timeout_at(deadline, conn.read(&mut buf))
            .await
            .expect("no answer in 10 s")
            .unwrap();
        assert!(n > 0, "connection closed; log:\n{}", plugin.log());
        received.extend_from_slice(&buf[..n]);
        while received.len() >= 9 {
            let len = (usize::from(received[0]) << 16)
                | (usize::from(received[1]) << 8)
                | usize::from(received[2]);
            if received.len() < 9 + len {
                break;
            }
            let (kind, flags) = (received[3], received[4]);
            let payload = received[9..9 + len].to_vec();
            received.drain(..9 + len);
            match kind {
                0x4 if flags & 0x1 == 0 => conn.write_all(&frame(0x4, 0x1, 0, &[])).await.unwrap(),
                0x3 => panic!(
                    "RST_STREAM {payload:?}: the authority was refused; log:\n{}",
                    plugin.log()
                ),
                0x0 => data.extend_from_slice(&payload),
                0x1 => {
                    let fields = decoder.decode(&payload).unwrap();
                    if flags & 0x1 != 0 {
                        trailers = Some(fields);
                    }
                }
                _ => {}
            }
        }
    }
    let trailers = trailers.unwrap_or_default();
    let status = trailers
        .iter()
        .find(|(n, _)| n == b"grpc-status")
        .map(|(_, v)| String::from_utf8_lossy(v).to_string());
    assert_eq!(status.as_deref(), Some("0"), "trailers {trailers:?}");
    assert!(data.len() >= 5, "no message");
    let info = sealed_csi::proto::pluginregistration::PluginInfo::decode(&data[5..]).unwrap();
    assert_eq!(info.name, "csi.sealedvolumes.io");
    assert_eq!(info.r#type, "CSIPlugin");
}
