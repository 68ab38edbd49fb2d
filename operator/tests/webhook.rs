//! The pod admission webhook on the real API server, controller-manager, scheduler and
//! kubelet (`hack/cluster.sh`), served by this test process as the operator serves it (its
//! own CA and certificate in a Secret, the caBundle put into a MutatingWebhookConfiguration
//! scoped to the test's namespace, with the chart's matchConditions and failure policies):
//!
//! - a Deployment of 4 replicas by tag: every pod is admitted with the digest the tag named;
//!   the tag moves, the Deployment scales to 6 and a pod is deleted: every pod of the old
//!   ReplicaSet still has the old digest; a new revision gets the new one;
//! - concurrent admissions of one revision agree (the conditional write: first writer wins);
//! - a Deployment following its tag (`sealedvolumes.io/follow-tags`): the tag moves, a new
//!   revision rolls out with the new digest; moved back, the
//!   Deployment goes back to its first ReplicaSet and digest;
//! - a pod asking for a T4 node is refused with the rule; one without a selector is kept off
//!   excluded nodes and scheduled;
//! - the webhook down: a pod by tag is refused (and the Deployment makes no pod), a pod by
//!   digest is admitted; back up with the same certificate (not made again), the Deployment
//!   gets its pods, with its revision's digest;
//! - a StatefulSet and a Job by tag: the tag moves, the StatefulSet scales and a pod of each is
//!   deleted: every pod keeps its revision's digest; a StatefulSet following its tag gets a new
//!   revision with the new digest when the tag moves, and its first revision back when the tag
//!   moves back (its pods replaced by deletion: `OnDelete`, since no pod becomes Ready here and
//!   a RollingUpdate StatefulSet waits for Ready pods).
//!
//! What is asserted is each admitted pod's volume attributes, not bytes read through it: no
//! node plugin runs here (pods stay in ContainerCreating), and the plugin mounts exactly the
//! `digest` attribute (csi-driver tests and the e2e journey read through it).
//!
//! Skipped (with a notice) unless `SEALED_E2E_CLUSTER=1`.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet, StatefulSet};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use sealed_crds::{SealedVolume, SealedVolumeVersion};
use sealed_e2e::wait_for;
use sealed_operator::webhook::follow::{self, FOLLOW_ANNOTATION, TEMPLATE_DIGESTS};
use sealed_operator::webhook::placement::{Exclusion, GPU_PRODUCT_LABEL};
use sealed_operator::webhook::pods::FROM_TAG_ATTRIBUTE;
use sealed_operator::webhook::revision::{RESOLVED_ANNOTATION, Revision, resolve_for_revision};
use sealed_operator::webhook::{WebhookConfig, start};

const TIMEOUT: Duration = Duration::from_secs(90);
const DRIVER: &str = "csi.sealedvolumes.io";
const SECRET: &str = "sealed-webhook-tls";
// The chart's matchConditions (charts/sealed-volumes/templates/webhook.yaml).
const TAGGED: &str = "has(object.spec.volumes) && object.spec.volumes.exists(v, has(v.csi) && v.csi.driver == 'csi.sealedvolumes.io' && has(v.csi.volumeAttributes) && 'tag' in v.csi.volumeAttributes)";
const SEALED: &str = "has(object.spec.volumes) && object.spec.volumes.exists(v, has(v.csi) && v.csi.driver == 'csi.sealedvolumes.io')";

fn digest(n: u8) -> String {
    format!("blake3:{}", format!("{n:02x}").repeat(32))
}

fn pod_spec(attrs: serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "terminationGracePeriodSeconds": 0,
        "containers": [{"name": "main", "image": sealed_e2e::BUSYBOX_IMAGE,
            "imagePullPolicy": "Never", "command": ["sleep", "3600"],
            "volumeMounts": [{"name": "weights", "mountPath": "/weights"}]}],
        "volumes": [{"name": "weights", "csi": {"driver": DRIVER, "readOnly": true,
            "volumeAttributes": attrs}}],
    })
}

fn attrs_of(pod: &Pod) -> BTreeMap<String, String> {
    pod.spec
        .as_ref()
        .and_then(|s| s.volumes.as_ref())
        .and_then(|v| v.first())
        .and_then(|v| v.csi.as_ref())
        .and_then(|c| c.volume_attributes.clone())
        .unwrap_or_default()
}

fn webhook_configuration(name: &str, ns: &str, port: u16) -> MutatingWebhookConfiguration {
    let hook = |hook: &str, policy: &str, conditions: serde_json::Value| {
        serde_json::json!({
            "name": hook,
            "admissionReviewVersions": ["v1"],
            "sideEffects": "NoneOnDryRun",
            "timeoutSeconds": 10,
            "reinvocationPolicy": "IfNeeded",
            "failurePolicy": policy,
            "clientConfig": {"url": format!("https://127.0.0.1:{port}/mutate-pods")},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                       "resources": ["pods"], "scope": "Namespaced"}],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
            "matchConditions": conditions,
        })
    };
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "webhooks": [
            hook("tags.pods.sealedvolumes.io", "Fail",
                 serde_json::json!([{"name": "names-a-sealed-tag", "expression": TAGGED}])),
            hook("placement.pods.sealedvolumes.io", "Ignore",
                 serde_json::json!([{"name": "has-a-sealed-volume", "expression": SEALED},
                                    {"name": "names-no-sealed-tag", "expression": format!("!({TAGGED})")}])),
        ],
    }))
    .expect("configuration")
}

struct Bed {
    client: Client,
    ns: String,
    config: WebhookConfig,
    cluster: sealed_e2e::Cluster,
}

impl Bed {
    async fn start(test: &str) -> Option<(Bed, tokio::task::JoinHandle<()>)> {
        let cluster = sealed_e2e::cluster(test).await?;
        let client = cluster.client.clone();
        sealed_e2e::install_crds(&client, "sealed-operator-test")
            .await
            .expect("install CRDs");
        let ns = cluster
            .temp_namespace("svol-hook")
            .await
            .expect("namespace");
        sealed_e2e::wait_for_default_service_account(&client, &ns)
            .await
            .expect("service account");
        let port = sealed_test_support::free_port();
        let name = format!("sealed-test-{ns}");
        Api::<MutatingWebhookConfiguration>::all(client.clone())
            .create(
                &PostParams::default(),
                &webhook_configuration(&name, &ns, port),
            )
            .await
            .expect("webhook configuration");
        let config = WebhookConfig {
            addr: format!("127.0.0.1:{port}").parse().expect("addr"),
            namespace: ns.clone(),
            secret: SECRET.into(),
            configuration: name,
            names: vec!["127.0.0.1".into()],
            exclusion: Exclusion::parse("Tesla-T4,NVIDIA-T4,T4,NVIDIA-L4,L4"),
        };
        let task = start(client.clone(), config.clone())
            .await
            .expect("webhook");
        let bed = Bed {
            client,
            ns,
            config,
            cluster,
        };
        Some((bed, task))
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    async fn stop(self) {
        let _ = Api::<MutatingWebhookConfiguration>::all(self.client.clone())
            .delete(&self.config.configuration, &DeleteParams::default())
            .await;
        let _ = self.cluster.delete_namespace(&self.ns).await;
    }

    /// A SealedVolume `llama` with versions 1 and 2 and tag `prod` → 1.
    async fn volume(&self) {
        let volume: SealedVolume = serde_json::from_value(serde_json::json!({
            "apiVersion": "sealedvolumes.io/v1alpha1", "kind": "SealedVolume",
            "metadata": {"name": "llama"},
            "spec": {"source": {"upload": {}}, "tags": {"prod": digest(1)}},
        }))
        .expect("volume");
        Api::<SealedVolume>::namespaced(self.client.clone(), &self.ns)
            .create(&PostParams::default(), &volume)
            .await
            .expect("create volume");
        let versions = Api::<SealedVolumeVersion>::namespaced(self.client.clone(), &self.ns);
        for n in [1, 2] {
            let v: SealedVolumeVersion = serde_json::from_value(serde_json::json!({
                "apiVersion": "sealedvolumes.io/v1alpha1", "kind": "SealedVolumeVersion",
                "metadata": {"name": format!("llama-v{n}")},
                "spec": {"volume": "llama", "digest": digest(n)},
            }))
            .expect("version");
            versions
                .create(&PostParams::default(), &v)
                .await
                .expect("create version");
        }
    }

    async fn move_tag(&self, to: u8) {
        Api::<SealedVolume>::namespaced(self.client.clone(), &self.ns)
            .patch(
                "llama",
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"spec": {"tags": {"prod": digest(to)}}})),
            )
            .await
            .expect("move tag");
    }

    /// The live (not terminating) pods of ReplicaSet `rs`.
    async fn pods_of(&self, rs: &str) -> Vec<Pod> {
        self.pods()
            .list(&ListParams::default())
            .await
            .expect("pods")
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| p.owner_references().iter().any(|o| o.name == rs))
            .collect()
    }

    /// The live pods whose controller is `kind` `name`.
    async fn pods_owned(&self, kind: &str, name: &str) -> Vec<Pod> {
        self.pods()
            .list(&ListParams::default())
            .await
            .expect("pods")
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| {
                p.owner_references()
                    .iter()
                    .any(|o| o.kind == kind && o.name == name)
            })
            .collect()
    }

    async fn wait_owned(&self, kind: &str, name: &str, n: usize) -> Vec<Pod> {
        wait_for(&format!("{n} pods of {kind} {name}"), TIMEOUT, || async {
            Ok(self.pods_owned(kind, name).await.len() == n)
        })
        .await
        .expect("pods");
        self.pods_owned(kind, name).await
    }

    async fn replica_sets(&self) -> Vec<ReplicaSet> {
        Api::<ReplicaSet>::namespaced(self.client.clone(), &self.ns)
            .list(&ListParams::default())
            .await
            .expect("replica sets")
            .items
    }

    async fn wait_pods(&self, rs: &str, n: usize) -> Vec<Pod> {
        wait_for(&format!("{n} pods of {rs}"), TIMEOUT, || async {
            Ok(self.pods_of(rs).await.len() == n)
        })
        .await
        .expect("pods");
        self.pods_of(rs).await
    }

    /// The ReplicaSet of Deployment `follow`'s template once that template pins `prod` at
    /// `want` and the ReplicaSet has pods (each checked to have `want`).
    async fn following(&self, want: &str) -> anyhow::Result<Option<String>> {
        let d = Api::<Deployment>::namespaced(self.client.clone(), &self.ns)
            .get("follow")
            .await?;
        let pins = |t: Option<&k8s_openapi::api::core::v1::PodTemplateSpec>| {
            t.and_then(|t| t.metadata.as_ref())
                .and_then(|m| m.annotations.as_ref())
                .and_then(|a| a.get(TEMPLATE_DIGESTS).cloned())
                .unwrap_or_default()
        };
        let pinned = pins(d.spec.as_ref().map(|s| &s.template));
        if !pinned.contains(want) {
            return Ok(None);
        }
        for rs in self.replica_sets().await {
            if pins(rs.spec.as_ref().and_then(|s| s.template.as_ref())) != pinned {
                continue;
            }
            let pods = self.pods_of(&rs.name_any()).await;
            if !pods.is_empty() {
                assert_digest(&pods, want);
                return Ok(Some(rs.name_any()));
            }
        }
        Ok(None)
    }

    /// Waits for [`following`](Self::following) `digest(n)`; the ReplicaSet's name.
    async fn follow_template_digest(&self, n: u8) -> String {
        let want = digest(n);
        wait_for(&format!("Deployment follow on {want}"), TIMEOUT, || async {
            Ok(self.following(&want).await?.is_some())
        })
        .await
        .expect("following");
        self.following(&want)
            .await
            .expect("following")
            .expect("replica set")
    }

    async fn scale(&self, replicas: i32) {
        Api::<Deployment>::namespaced(self.client.clone(), &self.ns)
            .patch(
                "web",
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"spec": {"replicas": replicas}})),
            )
            .await
            .expect("scale");
    }
}

fn assert_digest(pods: &[Pod], want: &str) {
    for p in pods {
        let attrs = attrs_of(p);
        assert_eq!(
            attrs.get("digest").map(String::as_str),
            Some(want),
            "pod {}: {attrs:?}",
            p.name_any()
        );
        assert_eq!(
            attrs.get(FROM_TAG_ATTRIBUTE).map(String::as_str),
            Some("llama:prod")
        );
        assert!(
            !attrs.contains_key("tag") && !attrs.contains_key("volume"),
            "{attrs:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_digest_per_revision_placement_and_the_webhook_down() {
    let Some((bed, webhook)) = Bed::start("webhook").await else {
        return;
    };
    bed.volume().await;

    // A Deployment of 4 replicas by tag.
    let deployment: Deployment = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 4,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}},
                         "spec": pod_spec(serde_json::json!({"volume": "llama", "tag": "prod"}))},
        },
    }))
    .expect("deployment");
    let deployments = Api::<Deployment>::namespaced(bed.client.clone(), &bed.ns);
    deployments
        .create(&PostParams::default(), &deployment)
        .await
        .expect("create deployment");
    wait_for("the first ReplicaSet", TIMEOUT, || async {
        Ok(!bed.replica_sets().await.is_empty())
    })
    .await
    .expect("replica set");
    let old_rs = bed.replica_sets().await[0].name_any();
    let pods = bed.wait_pods(&old_rs, 4).await;
    assert_digest(&pods, &digest(1));
    let rs = Api::<ReplicaSet>::namespaced(bed.client.clone(), &bed.ns)
        .get(&old_rs)
        .await
        .expect("rs");
    assert!(
        rs.annotations()
            .get(RESOLVED_ANNOTATION)
            .is_some_and(|r| r.contains(&digest(1)))
    );

    // The tag moves while it scales to 6 and a pod is deleted: the old revision keeps its digest.
    bed.move_tag(2).await;
    bed.scale(6).await;
    bed.pods()
        .delete(&pods[0].name_any(), &DeleteParams::default())
        .await
        .expect("delete a pod");
    let pods = bed.wait_pods(&old_rs, 6).await;
    assert_digest(&pods, &digest(1));

    // A new revision resolves the tag anew.
    deployments
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"template": {"metadata": {"annotations": {"rev": "2"}}}}})),
        )
        .await
        .expect("new revision");
    wait_for("the second ReplicaSet", TIMEOUT, || async {
        Ok(bed.replica_sets().await.len() == 2)
    })
    .await
    .expect("second replica set");
    let new_rs = bed
        .replica_sets()
        .await
        .into_iter()
        .map(|r| r.name_any())
        .find(|n| *n != old_rs)
        .expect("new rs");
    wait_for("a pod of the new revision", TIMEOUT, || async {
        Ok(!bed.pods_of(&new_rs).await.is_empty())
    })
    .await
    .expect("new pods");
    assert_digest(&bed.pods_of(&new_rs).await, &digest(2));
    assert_digest(&bed.pods_of(&old_rs).await, &digest(1));

    // Concurrent admissions of one revision agree: the first conditional write wins.
    let revision = Revision::Object {
        kind: "ReplicaSet",
        name: old_rs.clone(),
    };
    let fresh = Revision::Object {
        kind: "ReplicaSet",
        name: new_rs.clone(),
    };
    let wanted = vec![("other".to_string(), "t".to_string())];
    let mut tasks = Vec::new();
    for n in 0..8u8 {
        let (client, ns, rev, wanted) = (
            bed.client.clone(),
            bed.ns.clone(),
            fresh.clone(),
            wanted.clone(),
        );
        tasks.push(tokio::spawn(async move {
            resolve_for_revision(&client, &ns, &rev, &wanted, false, |_, _| async move {
                Ok(digest(10 + n))
            })
            .await
            .expect("resolve")
        }));
    }
    let mut seen = std::collections::BTreeSet::new();
    for t in tasks {
        seen.insert(t.await.expect("task")["other"]["t"].clone());
    }
    assert_eq!(seen.len(), 1, "concurrent admissions disagree: {seen:?}");
    let dry = resolve_for_revision(
        &bed.client,
        &bed.ns,
        &revision,
        &wanted,
        true,
        |_, _| async { Ok(digest(99)) },
    )
    .await
    .expect("dry run");
    assert_eq!(dry["other"]["t"], digest(99));
    let rs = Api::<ReplicaSet>::namespaced(bed.client.clone(), &bed.ns)
        .get(&old_rs)
        .await
        .expect("rs");
    assert!(
        !rs.annotations()[RESOLVED_ANNOTATION].contains("other"),
        "a dry run wrote"
    );

    // Placement: a T4 nodeSelector is refused with the rule; no selector → kept off excluded nodes.
    let mut spec = pod_spec(serde_json::json!({"digest": digest(1)}));
    spec["nodeSelector"] = serde_json::json!({GPU_PRODUCT_LABEL: "Tesla-T4"});
    let t4: Pod =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "t4"}, "spec": spec}))
            .expect("pod");
    let err = bed
        .pods()
        .create(&PostParams::default(), &t4)
        .await
        .expect_err("T4 refused");
    let text = err.to_string();
    assert!(
        text.contains("excludedGpuProducts") && text.contains("Tesla-T4"),
        "{text}"
    );
    let plain: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "plain"}, "spec": pod_spec(serde_json::json!({"digest": digest(1)})),
    }))
    .expect("pod");
    let admitted = bed
        .pods()
        .create(&PostParams::default(), &plain)
        .await
        .expect("plain pod");
    let affinity = serde_json::to_string(&admitted.spec.as_ref().and_then(|s| s.affinity.clone()))
        .expect("json");
    assert!(
        affinity.contains("NotIn") && affinity.contains("NVIDIA-L4-SHARED"),
        "{affinity}"
    );
    wait_for("the plain pod scheduled", TIMEOUT, || async {
        Ok(bed
            .pods()
            .get("plain")
            .await?
            .spec
            .and_then(|s| s.node_name)
            .is_some())
    })
    .await
    .expect("scheduled");

    // Tag-following rollouts: the tag moves, a rollout runs with the new digest; it moves
    // back, the Deployment goes back to its first ReplicaSet and digest.
    // Confined to this test's namespace, so it leaves other tests' workloads alone.
    let follower = tokio::spawn(follow::run_in(
        bed.client.clone(),
        Some(vec![bed.ns.clone()]),
    ));
    let mut following = deployment.clone();
    following.metadata.name = Some("follow".into());
    following.metadata.annotations =
        Some([(FOLLOW_ANNOTATION.to_string(), "true".to_string())].into());
    if let Some(spec) = following.spec.as_mut() {
        spec.replicas = Some(2);
        // Old revisions' pods never become ready here (no node plugin): let them go at once,
        // or a third revision could wait for room forever.
        spec.strategy = serde_json::from_value(serde_json::json!(
            {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": "100%"}}))
        .ok();
        spec.selector.match_labels = Some([("app".to_string(), "follow".to_string())].into());
        if let Some(m) = spec.template.metadata.as_mut() {
            m.labels = spec.selector.match_labels.clone();
        }
    }
    deployments
        .create(&PostParams::default(), &following)
        .await
        .expect("following deployment");
    let first = bed.follow_template_digest(2).await;
    bed.move_tag(1).await;
    let second = bed.follow_template_digest(1).await;
    assert_ne!(first, second, "no new revision after the tag moved");
    bed.move_tag(2).await;
    let back = bed.follow_template_digest(2).await;
    assert_eq!(
        back, first,
        "moving the tag back did not go back to the first ReplicaSet"
    );
    follower.abort();

    // The webhook down: a pod by tag is refused, the Deployment makes none; a pod by digest
    // is admitted (without placement).
    let secret_before = Api::<Secret>::namespaced(bed.client.clone(), &bed.ns)
        .get(SECRET)
        .await
        .expect("secret");
    webhook.abort();
    let _ = webhook.await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let by_tag: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "by-tag"}, "spec": pod_spec(serde_json::json!({"volume": "llama", "tag": "prod"})),
    }))
    .expect("pod");
    let err = bed
        .pods()
        .create(&PostParams::default(), &by_tag)
        .await
        .expect_err("refused while down");
    assert!(
        err.to_string().contains("tags.pods.sealedvolumes.io"),
        "{err}"
    );
    let by_digest: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "by-digest"}, "spec": pod_spec(serde_json::json!({"digest": digest(1)})),
    }))
    .expect("pod");
    bed.pods()
        .create(&PostParams::default(), &by_digest)
        .await
        .expect("admitted while down");
    // Scale the old revision's Deployment back to its first template: the old ReplicaSet
    // must grow, and cannot while the webhook is down.
    deployments
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Json::<()>(
                serde_json::from_value(serde_json::json!([
                {"op": "remove", "path": "/spec/template/metadata/annotations"}]))
                .expect("patch"),
            ),
        )
        .await
        .expect("roll back");
    bed.scale(7).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let during = bed.pods_of(&old_rs).await.len();
    assert!(
        during < 7,
        "pods were created while the webhook was down: {during}"
    );

    // Back up: the same certificate (not made again), and the old revision gets its pods
    // with its own digest although the tag names 2.
    let again = start(bed.client.clone(), bed.config.clone())
        .await
        .expect("webhook again");
    let secret_after = Api::<Secret>::namespaced(bed.client.clone(), &bed.ns)
        .get(SECRET)
        .await
        .expect("secret");
    let cert = |s: &Secret| {
        s.data
            .as_ref()
            .and_then(|d| d.get("tls.crt"))
            .cloned()
            .unwrap_or(ByteString(vec![]))
    };
    assert_eq!(
        cert(&secret_before),
        cert(&secret_after),
        "the certificate was made again"
    );
    wait_for(
        "the old revision's pods after the webhook is back",
        TIMEOUT,
        || async { Ok(bed.pods_of(&old_rs).await.len() > during) },
    )
    .await
    .expect("pods after the webhook is back");
    assert_digest(&bed.pods_of(&old_rs).await, &digest(1));

    again.abort();
    bed.stop().await;
}

fn stateful_set(name: &str, replicas: i32, follow: bool) -> StatefulSet {
    let annotations = if follow {
        serde_json::json!({FOLLOW_ANNOTATION: "true"})
    } else {
        serde_json::json!({})
    };
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "annotations": annotations},
        "spec": {
            "replicas": replicas,
            "serviceName": name,
            // Pods never become Ready here (no node plugin): Parallel creates them all, and
            // OnDelete replaces a pod of an older revision when it is deleted.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}},
                         "spec": pod_spec(serde_json::json!({"volume": "llama", "tag": "prod"}))},
        },
    }))
    .expect("statefulset")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stateful_sets_and_jobs_keep_one_digest_per_revision_and_follow_their_tag() {
    let Some((bed, webhook)) = Bed::start("webhook_statefulset_job").await else {
        return;
    };
    bed.volume().await;
    let sets = Api::<StatefulSet>::namespaced(bed.client.clone(), &bed.ns);
    sets.create(&PostParams::default(), &stateful_set("db", 2, false))
        .await
        .expect("create statefulset");
    let mut spec = pod_spec(serde_json::json!({"volume": "llama", "tag": "prod"}));
    spec["restartPolicy"] = "Never".into();
    let job: Job = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "train"},
        "spec": {"parallelism": 2, "completions": 8, "backoffLimit": 100,
                 "template": {"spec": spec}},
    }))
    .expect("job");
    let jobs = Api::<Job>::namespaced(bed.client.clone(), &bed.ns);
    jobs.create(&PostParams::default(), &job)
        .await
        .expect("create job");
    let db = bed.wait_owned("StatefulSet", "db", 2).await;
    assert_digest(&db, &digest(1));
    let train = bed.wait_owned("Job", "train", 2).await;
    assert_digest(&train, &digest(1));

    // The tag moves; the StatefulSet scales to 3, a pod of each is deleted: same digest.
    bed.move_tag(2).await;
    sets.patch(
        "db",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"replicas": 3}})),
    )
    .await
    .expect("scale");
    jobs.patch(
        "train",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"parallelism": 3}})),
    )
    .await
    .expect("job parallelism");
    for pod in [&db[0], &train[0]] {
        bed.pods()
            .delete(&pod.name_any(), &DeleteParams::default())
            .await
            .expect("delete a pod");
    }
    wait_for("db-0 replaced", TIMEOUT, || async {
        Ok(bed
            .pods_owned("StatefulSet", "db")
            .await
            .iter()
            .any(|p| p.name_any() == db[0].name_any() && p.uid() != db[0].uid()))
    })
    .await
    .expect("db-0 again");
    assert_digest(&bed.wait_owned("StatefulSet", "db", 3).await, &digest(1));
    assert_digest(&bed.wait_owned("Job", "train", 3).await, &digest(1));

    // A StatefulSet following its tag: created while prod names 2, it moves to 1: a new
    // revision with 1; moved back to 2: its first revision again, with 2.
    // Created first: the follower looks at a namespace's workloads when it starts and when a
    // volume changes.
    sets.create(&PostParams::default(), &stateful_set("fdb", 1, true))
        .await
        .expect("following statefulset");
    // Confined to this test's namespace, so it leaves other tests' workloads alone.
    let follower = tokio::spawn(follow::run_in(
        bed.client.clone(),
        Some(vec![bed.ns.clone()]),
    ));
    let revision = |n: u8| {
        let (sets, want) = (sets.clone(), digest(n));
        async move {
            let rev = std::sync::Mutex::new(None);
            wait_for(&format!("StatefulSet fdb on {want}"), TIMEOUT, || async {
                let s = sets.get("fdb").await?;
                let pinned = s
                    .spec
                    .as_ref()
                    .and_then(|s| s.template.metadata.as_ref())
                    .and_then(|m| m.annotations.as_ref())
                    .and_then(|a| a.get(TEMPLATE_DIGESTS).cloned())
                    .unwrap_or_default();
                let status = s.status.unwrap_or_default();
                *rev.lock().expect("lock") = status.update_revision.clone();
                Ok(pinned.contains(&want) && status.observed_generation == s.metadata.generation)
            })
            .await
            .expect("template");
            rev.into_inner().expect("lock").expect("update revision")
        }
    };
    // The pod of the StatefulSet's current update revision, after deleting any other.
    let pod_of = |rev: String| {
        let bed = &bed;
        async move {
            let found = std::sync::Mutex::new(None);
            wait_for(&format!("fdb-0 of revision {rev}"), TIMEOUT, || async {
                let pods = bed.pods_owned("StatefulSet", "fdb").await;
                for p in &pods {
                    if p.labels().get("controller-revision-hash") == Some(&rev) {
                        *found.lock().expect("lock") = Some(p.clone());
                        return Ok(true);
                    }
                    let _ = bed
                        .pods()
                        .delete(&p.name_any(), &DeleteParams::default())
                        .await;
                }
                Ok(false)
            })
            .await
            .expect("pod of the revision");
            found.into_inner().expect("lock").expect("pod")
        }
    };
    let first = revision(2).await;
    assert_digest(&[pod_of(first.clone()).await], &digest(2));
    bed.move_tag(1).await;
    let second = revision(1).await;
    assert_ne!(first, second, "no new revision after the tag moved");
    assert_digest(&[pod_of(second).await], &digest(1));
    bed.move_tag(2).await;
    let back = revision(2).await;
    assert_eq!(
        back, first,
        "moving the tag back did not go back to the first revision"
    );
    assert_digest(&[pod_of(back).await], &digest(2));
    follower.abort();

    webhook.abort();
    bed.stop().await;
}

/// An operator confined to some namespaces (`--watch-namespace`) never rolls out a following
/// workload of another namespace; one that watches the workload's namespace does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tags_are_followed_only_in_the_watched_namespaces() {
    let Some((bed, webhook)) = Bed::start("webhook-follow-scope").await else {
        return;
    };
    bed.volume().await;
    // No pods needed: what a tag move changes is the template.
    let deployment: Deployment = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "follow", "annotations": {FOLLOW_ANNOTATION: "true"}},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": "follow"}},
            "template": {"metadata": {"labels": {"app": "follow"}},
                         "spec": pod_spec(serde_json::json!({"volume": "llama", "tag": "prod"}))},
        },
    }))
    .expect("deployment");
    let deployments = Api::<Deployment>::namespaced(bed.client.clone(), &bed.ns);
    deployments
        .create(&PostParams::default(), &deployment)
        .await
        .expect("create deployment");
    let pinned = || async {
        deployments
            .get("follow")
            .await
            .expect("deployment")
            .spec
            .and_then(|s| s.template.metadata)
            .and_then(|m| m.annotations)
            .and_then(|a| a.get(TEMPLATE_DIGESTS).cloned())
    };

    let elsewhere = tokio::spawn(follow::run_in(
        bed.client.clone(),
        Some(vec![format!("{}-not-this-one", bed.ns)]),
    ));
    bed.move_tag(2).await;
    // The follower acts at once on a change (and on its first list): give it time to.
    tokio::time::sleep(Duration::from_secs(5)).await;
    elsewhere.abort();
    assert_eq!(
        pinned().await,
        None,
        "a follower watching another namespace rolled out this one's workload"
    );

    let here = tokio::spawn(follow::run_in(
        bed.client.clone(),
        Some(vec![bed.ns.clone()]),
    ));
    wait_for("the follower of this namespace", TIMEOUT, || async {
        Ok(pinned().await.is_some_and(|p| p.contains(&digest(2))))
    })
    .await
    .expect("followed");
    here.abort();

    webhook.abort();
    bed.stop().await;
}
