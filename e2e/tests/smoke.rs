//! Smoke tests for the local cluster: the API server serves CRDs and watches, and the
//! node runs a pod from an imported image to completion.
//! They run only with `SEALED_E2E_CLUSTER=1` (see `sealed_e2e::cluster`).

use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::runtime::wait::{await_condition, conditions};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};

const CRD_NAME: &str = "smokewidgets.e2e.sealedvolumes.io";

fn smoke_crd() -> Result<CustomResourceDefinition> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": { "name": CRD_NAME },
        "spec": {
            "group": "e2e.sealedvolumes.io",
            "scope": "Namespaced",
            "names": { "plural": "smokewidgets", "singular": "smokewidget", "kind": "SmokeWidget" },
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "schema": { "openAPIV3Schema": {
                    "type": "object",
                    "properties": { "spec": {
                        "type": "object",
                        "properties": { "digest": { "type": "string" } }
                    }}
                }}
            }]
        }
    }))?)
}

async fn install_crd(client: &Client) -> Result<()> {
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    crds.patch(
        CRD_NAME,
        &PatchParams::apply("sealed-e2e").force(),
        &Patch::Apply(smoke_crd()?),
    )
    .await
    .context("cannot apply the CRD")?;
    let established = await_condition(crds, CRD_NAME, conditions::is_crd_established());
    tokio::time::timeout(Duration::from_secs(30), established)
        .await
        .context("the CRD was not established within 30s")??;
    Ok(())
}

/// Creates `obj`, retrying while the new CRD's endpoint still answers 404.
async fn create_retrying(api: &Api<DynamicObject>, obj: &DynamicObject) -> Result<()> {
    let mut attempt = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        match api.create(&PostParams::default(), obj).await {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 && attempt < 50 => attempt += 1,
            Err(e) => return Err(e).context("cannot create the custom object"),
        }
    }
}

#[tokio::test]
async fn crd_object_is_seen_by_a_watcher() -> Result<()> {
    let Some(cluster) = sealed_e2e::cluster("crd_object_is_seen_by_a_watcher").await else {
        return Ok(());
    };
    install_crd(&cluster.client).await?;
    let ns = cluster.temp_namespace("e2e-crd").await?;

    let gvk = GroupVersionKind::gvk("e2e.sealedvolumes.io", "v1", "SmokeWidget");
    let ar = ApiResource::from_gvk_with_plural(&gvk, "smokewidgets");
    let api = Api::<DynamicObject>::namespaced_with(cluster.client.clone(), &ns, &ar);

    // Start watching before the create, so the test proves the watch delivers it.
    // Right after a CRD is established its endpoint can still answer 404 for a moment;
    // the watcher retries (with backoff) and its transient errors are only logged.
    let mut seen = watcher(api.clone(), watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .filter_map(|r| {
            futures::future::ready(match r {
                Ok(o) if o.metadata.name.as_deref() == Some("w1") => Some(o),
                Ok(_) => None,
                Err(e) => {
                    eprintln!("watch error (retried): {e}");
                    None
                }
            })
        })
        .boxed();
    let obj: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "e2e.sealedvolumes.io/v1",
        "kind": "SmokeWidget",
        "metadata": { "name": "w1" },
        "spec": { "digest": "blake3:00ff" }
    }))?;
    // The watcher's first list may race the create; either way the object must arrive.
    let (got, created) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(30), seen.next()),
        create_retrying(&api, &obj)
    );
    created?;
    let got = got
        .context("the watcher saw nothing within 30s")?
        .context("the watch stream ended")?;
    assert_eq!(got.data["spec"]["digest"], "blake3:00ff");

    cluster.delete_namespace(&ns).await?;
    Api::<CustomResourceDefinition>::all(cluster.client.clone())
        .delete(CRD_NAME, &DeleteParams::default())
        .await
        .context("cannot delete the CRD")?;
    Ok(())
}

#[tokio::test]
async fn busybox_pod_runs_to_completion() -> Result<()> {
    let Some(cluster) = sealed_e2e::cluster("busybox_pod_runs_to_completion").await else {
        return Ok(());
    };
    let ns = cluster.temp_namespace("e2e-pod").await?;
    // Also proves the pod network and kube-proxy: the API server's Service answers.
    let pod = sealed_e2e::busybox_pod(
        "hello",
        // Plain HTTP to the TLS port: Go's server answers 400 in plain text, which proves
        // the path without needing a TLS client in the image.
        "echo hello-from-sealed; \
         printf 'GET / HTTP/1.0\\r\\n\\r\\n' | \
         nc -w 5 \"$KUBERNETES_SERVICE_HOST\" \"$KUBERNETES_SERVICE_PORT\"",
    )?;
    let (phase, log) = cluster
        .run_pod_to_completion(&ns, &pod, Duration::from_secs(120))
        .await?;
    assert_eq!(phase, "Succeeded", "pod log:\n{log}");
    assert!(log.contains("hello-from-sealed"), "pod log:\n{log}");
    assert!(
        log.contains("Client sent an HTTP request to an HTTPS server"),
        "the API server was not reachable through its Service; pod log:\n{log}"
    );
    cluster.delete_namespace(&ns).await?;
    Ok(())
}

#[tokio::test]
async fn image_from_a_static_binary_runs() -> Result<()> {
    let Some(cluster) = sealed_e2e::cluster("image_from_a_static_binary_runs").await else {
        return Ok(());
    };
    // busybox-static stands in for our own static binaries (operator, CSI plugin).
    sealed_e2e::image_from_binary(
        "sealed.local/e2e-static:v1",
        std::path::Path::new("/bin/busybox"),
        &[],
    )?;
    let ns = cluster.temp_namespace("e2e-img").await?;
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "static" },
        "spec": {
            "restartPolicy": "Never",
            "containers": [{
                "name": "main",
                "image": "sealed.local/e2e-static:v1",
                "imagePullPolicy": "Never",
                "args": ["echo", "static-binary-image-ok"],
            }],
        }
    }))?;
    let (phase, log) = cluster
        .run_pod_to_completion(&ns, &pod, Duration::from_secs(120))
        .await?;
    assert_eq!(phase, "Succeeded", "pod log:\n{log}");
    assert!(log.contains("static-binary-image-ok"), "pod log:\n{log}");
    cluster.delete_namespace(&ns).await?;
    Ok(())
}

#[tokio::test]
async fn bidirectional_mount_propagation_reaches_the_host() -> Result<()> {
    let Some(cluster) =
        sealed_e2e::cluster("bidirectional_mount_propagation_reaches_the_host").await
    else {
        return Ok(());
    };
    // The CSI node plugin mounts inside its container and the kubelet must see the mount.
    let ns = cluster.temp_namespace("e2e-prop").await?;
    let host_dir = sealed_e2e::cluster_dir().join(format!("e2e-{ns}"));
    std::fs::create_dir_all(host_dir.join("m"))
        .with_context(|| format!("cannot create {}", host_dir.display()))?;
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "mounter" },
        "spec": {
            "restartPolicy": "Never",
            "containers": [{
                "name": "main",
                "image": sealed_e2e::BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", "mount -t tmpfs e2e /host/m && echo propagated > /host/m/f"],
                "securityContext": { "privileged": true },
                "volumeMounts": [{ "name": "host", "mountPath": "/host", "mountPropagation": "Bidirectional" }],
            }],
            "volumes": [{ "name": "host", "hostPath": { "path": host_dir, "type": "Directory" } }],
        }
    }))?;
    let (phase, log) = cluster
        .run_pod_to_completion(&ns, &pod, Duration::from_secs(120))
        .await?;
    let seen = std::fs::read_to_string(host_dir.join("m/f"));
    // Unmount before asserting, so a failure leaves no mount behind.
    let _ = std::process::Command::new("umount")
        .arg(host_dir.join("m"))
        .status();
    assert_eq!(phase, "Succeeded", "pod log:\n{log}");
    assert_eq!(
        seen.context("the pod's mount did not reach the host")?
            .trim(),
        "propagated"
    );
    std::fs::remove_dir_all(&host_dir).ok();
    cluster.delete_namespace(&ns).await?;
    Ok(())
}
