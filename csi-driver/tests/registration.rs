//! kubelet plugin registration against the real binary: with `--kubelet-dir` it serves
//! `pluginregistration.Registration` on `<kubelet-dir>/plugins_registry/csi.sealedvolumes.io-reg.sock`
//! and points kubelet at its CSI socket; the socket goes away when the plugin stops.

mod common;

use common::{Plugin, connect, store_with_version};
use sealed_csi::pluginregistration::registration_client::RegistrationClient;
use sealed_csi::pluginregistration::{InfoRequest, RegistrationStatus};

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
