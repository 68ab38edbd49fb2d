//! `sealed sync SOURCE --volume NS/NAME`: have the operator sync a Hugging Face repo or a
//! bucket prefix into the store, follow it, and print the sealed digest. Nothing is
//! downloaded to this machine: the sync runs in the cluster (a Job, or the operator).
//!
//! An `oci://` source (a ModelPack artifact, or an image's `--oci-path` directory) is, for
//! now, synced from this machine straight into `--store` ([`run_oci`]), as `sealed push`
//! writes: the API has no `spec.source.oci` yet. The same reader, policy and checks as the
//! operator's (`sealed_sources`), with no default loopback or plain-http exceptions.
//!
//! The source is written with server-side apply as field manager [`FIELD_MANAGER`], so a
//! source that Git owns (Argo CD's `argocd-controller`, Flux, `kubectl apply`) is not
//! overwritten behind its back: the API server's conflict is reported with the other
//! manager's name, and `--force` takes the source over.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt};
use sealed_crds::{
    CONDITION_SYNCED, RESYNC_ANNOTATION, SealedVolume, SecretKeyRef, SecretRef, Source,
};

use crate::context::Context;
use crate::output::print_json;

#[derive(Args, Debug)]
pub struct SyncArgs {
    /// hf://org/repo[@revision], hf://datasets/org/name[@revision], s3://bucket/prefix,
    /// gs://bucket/prefix, az://container/prefix, oci://REGISTRY/REPO:TAG or
    /// oci://REGISTRY/REPO@sha256:DIGEST (synced here into --store)
    pub source: String,
    /// The SealedVolume to create or update, NAMESPACE/NAME (oci://: the volume the version
    /// is recorded under in the store)
    #[arg(long)]
    pub volume: String,
    /// oci:// images: the directory of the image's filesystem to seal, e.g. /models (not for
    /// ModelPack artifacts)
    #[arg(long, value_name = "DIR")]
    pub oci_path: Option<String>,
    /// oci://: a docker config JSON file with the registry's credentials (as a
    /// kubernetes.io/dockerconfigjson Secret's .dockerconfigjson)
    #[arg(long, value_name = "FILE")]
    pub pull_secret: Option<std::path::PathBuf>,
    /// oci://: reach a registry in this address range although it is loopback, private or
    /// link-local (repeatable)
    #[arg(long = "allow-source-network", value_name = "CIDR")]
    pub allow_source_network: Vec<String>,
    /// oci://: allow a plain http registry (--source-endpoint http://…)
    #[arg(long = "allow-http-sources")]
    pub allow_http_sources: bool,
    /// Only files matching these globs (Hugging Face), e.g. '*.safetensors'
    #[arg(long)]
    pub include: Vec<String>,
    /// Leave out files matching these globs (Hugging Face)
    #[arg(long)]
    pub exclude: Vec<String>,
    /// Secret with the Hugging Face token, as NAME:KEY (in the volume's namespace)
    #[arg(long, value_name = "NAME:KEY")]
    pub token_secret: Option<String>,
    /// Secret with the bucket's credentials (env-style keys, in the volume's namespace)
    #[arg(long, value_name = "NAME")]
    pub credentials_secret: Option<String>,
    /// S3-compatible endpoint of the bucket (R2, CoreWeave, MinIO), or a Hub mirror for hf://
    #[arg(long = "source-endpoint")]
    pub source_endpoint: Option<String>,
    /// Region of the bucket
    #[arg(long = "source-region")]
    pub source_region: Option<String>,
    /// Return once the sync has started instead of following it
    #[arg(long)]
    pub no_wait: bool,
    /// Give up following after this many seconds (the sync goes on in the cluster); at
    /// most 2592000 (30 days)
    #[arg(long, default_value_t = 3600,
          value_parser = clap::value_parser!(u64).range(0..=2_592_000))]
    pub wait_timeout: u64,
    /// Overwrite a source another field manager owns (Git, through Argo CD, Flux or
    /// `kubectl apply`); the next GitOps sync puts Git's source back
    #[arg(long)]
    pub force: bool,
    #[command(flatten)]
    pub kube: crate::kube_args::KubeArgs,
}

/// The field manager of the fields `sealed sync` applies (`spec.source` and the resync
/// annotation).
pub const FIELD_MANAGER: &str = "sealed";

#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct SyncResult {
    volume: String,
    source: String,
    digest: Option<String>,
    version: Option<String>,
    revision: Option<String>,
    state: String,
}

/// The source the flags describe.
fn source(args: &SyncArgs) -> anyhow::Result<Source> {
    let mut source = Source::from_uri(&args.source).map_err(|e| anyhow::anyhow!("{e}"))?;
    if let Some(hf) = source.hugging_face.as_mut() {
        hf.include = args.include.clone();
        hf.exclude = args.exclude.clone();
        hf.endpoint = args.source_endpoint.clone();
        if let Some(spec) = &args.token_secret {
            let (name, key) = spec
                .split_once(':')
                .with_context(|| format!("--token-secret {spec:?} must be NAME:KEY"))?;
            hf.token_secret_ref = Some(SecretKeyRef {
                name: name.into(),
                key: key.into(),
            });
        }
    } else if let Some(os) = source.object_store.as_mut() {
        os.endpoint = args.source_endpoint.clone();
        os.region = args.source_region.clone();
        os.credentials_secret_ref = args
            .credentials_secret
            .as_ref()
            .map(|name| SecretRef { name: name.clone() });
    } else {
        bail!(
            "{:?} is not something to sync; `sealed push --volume` publishes a local directory",
            args.source
        );
    }
    if source.object_store.is_some() && (!args.include.is_empty() || !args.exclude.is_empty()) {
        bail!("--include and --exclude apply to Hugging Face sources");
    }
    Ok(source)
}

pub async fn run(ctx: &Context, args: SyncArgs) -> anyhow::Result<ExitCode> {
    if args.source.starts_with("oci://") {
        return run_oci(ctx, args).await;
    }
    if args.oci_path.is_some()
        || args.pull_secret.is_some()
        || !args.allow_source_network.is_empty()
        || args.allow_http_sources
    {
        bail!(
            "--oci-path, --pull-secret, --allow-source-network and --allow-http-sources apply to oci:// sources"
        );
    }
    let source = source(&args)?;
    // kubectl's --kubeconfig, --context and -n; `--volume NAME` is in -n's namespace.
    let (client, default_ns) = args.kube.client().await?;
    let (namespace, name) = args
        .volume
        .split_once('/')
        .unwrap_or((default_ns.as_str(), args.volume.as_str()));
    if namespace.is_empty() || name.is_empty() {
        bail!("--volume {:?} must be NAME or NAMESPACE/NAME", args.volume);
    }
    let api: Api<SealedVolume> = Api::namespaced(client, namespace);
    let volume = apply_source(&api, namespace, name, &source, args.force).await?;
    let trigger = volume.sync_trigger();
    let mut result = SyncResult {
        volume: format!("{namespace}/{name}"),
        source: source.summary(),
        digest: None,
        version: None,
        revision: None,
        state: "Started".into(),
    };
    if args.no_wait {
        return finish(ctx, &result, ExitCode::SUCCESS);
    }

    let bar = if ctx.progress {
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} {msg} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_message(format!(
            "syncing {} into {namespace}/{name}",
            source.summary()
        ));
        bar.enable_steady_tick(Duration::from_millis(200));
        Some(bar)
    } else {
        None
    };
    let deadline = Instant::now() + Duration::from_secs(args.wait_timeout);
    loop {
        let v = api
            .get(name)
            .await
            .with_context(|| format!("cannot read SealedVolume {namespace}/{name}"))?;
        let status = v.status.clone().unwrap_or_default();
        let sync = status
            .sync
            .clone()
            .filter(|s| s.trigger.as_deref() == Some(trigger.as_str()));
        if let (Some(bar), Some(s)) = (&bar, &sync) {
            bar.set_length(s.bytes_total.max(0) as u64);
            bar.set_position(s.bytes_done.max(0) as u64);
        }
        if let Some(s) = sync.filter(|s| s.finished_at.is_some()) {
            if let Some(bar) = &bar {
                bar.finish_and_clear();
            }
            let synced = status.condition(CONDITION_SYNCED);
            if s.digest.is_some() {
                result.digest = s.digest.clone();
                result.revision = s.revision.clone();
                result.version = status
                    .latest_version
                    .clone()
                    .filter(|_| status.latest_digest == s.digest);
                result.state = "Synced".into();
                return finish(ctx, &result, ExitCode::SUCCESS);
            }
            let (reason, message) = synced
                .map(|c| (c.reason.clone(), c.message.clone()))
                .unwrap_or_else(|| ("SyncFailed".into(), "no reason recorded".into()));
            bail!(
                "sync of {} into {namespace}/{name} failed: {reason}: {message}",
                source.summary()
            );
        }
        // A failure before the sync could start (e.g. a missing Secret): the operator keeps
        // retrying, but the user should hear of it now.
        if let Some(c) = status.condition(CONDITION_SYNCED)
            && c.status == "False"
            && c.reason != "Syncing"
            && status.sync.as_ref().is_some_and(|s| {
                s.trigger.as_deref() == Some(trigger.as_str()) && s.started_at.is_none()
            })
        {
            if let Some(bar) = &bar {
                bar.finish_and_clear();
            }
            bail!(
                "cannot sync {} into {namespace}/{name}: {}: {} (the operator retries every 30 s)",
                source.summary(),
                c.reason,
                c.message
            );
        }
        if Instant::now() > deadline {
            bail!(
                "gave up waiting after {}s; the sync goes on: `kubectl get svol -n {namespace} {name} -o wide`",
                args.wait_timeout
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `sealed sync oci://…`: reads the registry from here and seals into `--store`, recording
/// the version under `--volume`; prints the digest (`-o json`: the whole outcome, with the
/// manifest digest as `sourceRevision`).
async fn run_oci(ctx: &Context, args: SyncArgs) -> anyhow::Result<ExitCode> {
    use sealed_sources::egress::{ALLOW_NETWORK_FLAG, Egress};
    use sealed_sources::{
        NoReporter, OciArtifact, SourceCredentials, SourcePolicy, SourceSpec, SyncOptions,
    };
    if !args.include.is_empty()
        || !args.exclude.is_empty()
        || args.token_secret.is_some()
        || args.credentials_secret.is_some()
        || args.source_region.is_some()
    {
        bail!(
            "--include, --exclude, --token-secret, --credentials-secret and --source-region do \
             not apply to oci:// sources (--pull-secret FILE takes a docker config JSON)"
        );
    }
    let docker_config = match &args.pull_secret {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("cannot read --pull-secret {}", path.display()))?,
        ),
        None => None,
    };
    let allowed = Egress::parse_networks(&args.allow_source_network, ALLOW_NETWORK_FLAG)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let spec = SourceSpec::Oci(OciArtifact {
        reference: args.source.clone(),
        path: args.oci_path.clone(),
        endpoint: args.source_endpoint.clone(),
    });
    let opts = SyncOptions {
        volume: Some(args.volume.clone()),
        policy: SourcePolicy {
            allow_http: args.allow_http_sources,
            egress: Egress {
                allowed,
                ..Default::default()
            },
            ..Default::default()
        },
        ..Default::default()
    };
    let creds = SourceCredentials {
        docker_config,
        ..Default::default()
    };
    let store = ctx.open_store_for_push().await?;
    let outcome = sealed_sources::sync_source(&store, &spec, &creds, &opts, Arc::new(NoReporter))
        .await
        .with_context(|| format!("cannot sync {}", args.source))?;
    if ctx.json() {
        print_json(&outcome)?;
    } else {
        println!("{}", outcome.digest);
    }
    Ok(ExitCode::SUCCESS)
}

/// Creates the volume, changes its source, or asks for a resync of the same source: one
/// server-side apply of `spec.source` and the resync annotation as [`FIELD_MANAGER`].
async fn apply_source(
    api: &Api<SealedVolume>,
    namespace: &str,
    name: &str,
    source: &Source,
    force: bool,
) -> anyhow::Result<SealedVolume> {
    let existing = api
        .get_opt(name)
        .await
        .with_context(|| format!("cannot read SealedVolume {namespace}/{name}"))?;
    if let Some(existing) = &existing {
        if existing.spec.source != *source && existing.spec.source.upload.is_some() {
            bail!(
                "{namespace}/{name} takes versions from `sealed push`; give sync another volume name"
            );
        }
        // Another kind of source: the API server sees no conflict (the other manager's
        // fields are not the ones applied) and would keep both, so it is checked here.
        let old_kind = source_kind(&existing.spec.source);
        if old_kind != source_kind(source) {
            let owners = source_managers(existing);
            if !owners.is_empty() && !force {
                bail!(owned_elsewhere(namespace, name, &owners.join(", ")));
            }
            if let Some(old) = old_kind.filter(|_| !owners.is_empty()) {
                // Taking it over: the other manager's source goes first.
                let new_kind = source_kind(source).unwrap_or("upload");
                let patch = serde_json::json!({ "spec": { "source": {
                    old: null,
                    new_kind: source_field(source),
                }}});
                let params = PatchParams {
                    field_manager: Some(FIELD_MANAGER.into()),
                    ..Default::default()
                };
                api.patch(name, &params, &Patch::Merge(&patch))
                    .await
                    .with_context(|| format!("cannot update SealedVolume {namespace}/{name}"))?;
            }
        }
    }
    let stamp = k8s_openapi::jiff::Timestamp::now().to_string();
    let patch = serde_json::json!({
        "apiVersion": sealed_crds::API_VERSION,
        "kind": "SealedVolume",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "annotations": { RESYNC_ANNOTATION: stamp },
        },
        "spec": { "source": source },
    });
    let mut params = PatchParams::apply(FIELD_MANAGER);
    if force {
        params = params.force();
    }
    let verb = if existing.is_some() {
        "update"
    } else {
        "create"
    };
    match api.patch(name, &params, &Patch::Apply(&patch)).await {
        Ok(v) => Ok(v),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let owners = conflicting_managers(&e.message);
            let owners = if owners.is_empty() {
                "another field manager".to_owned()
            } else {
                owners.join(", ")
            };
            Err(anyhow::anyhow!("{}", e.message)).context(owned_elsewhere(namespace, name, &owners))
        }
        Err(e) => Err(e).with_context(|| format!("cannot {verb} SealedVolume {namespace}/{name}")),
    }
}

/// The refusal of a source owned elsewhere: who owns it and the two ways on.
fn owned_elsewhere(namespace: &str, name: &str, owners: &str) -> String {
    format!(
        "the source of SealedVolume {namespace}/{name} is managed by {owners} (Git, through a \
         GitOps tool or kubectl apply): change it where it is kept, or run again with --force \
         to take it over (the next GitOps sync may put it back)"
    )
}

/// `huggingFace`, `objectStore` or `upload`: the field of the source's one kind.
fn source_kind(source: &Source) -> Option<&'static str> {
    use sealed_crds::SourceKind as K;
    match source.kind().ok()? {
        K::HuggingFace(_) => Some("huggingFace"),
        K::ObjectStore(_) => Some("objectStore"),
        K::Upload(_) => Some("upload"),
    }
}

/// The value of the source's one kind, as the API spells it.
fn source_field(source: &Source) -> serde_json::Value {
    let all = serde_json::to_value(source).unwrap_or_default();
    source_kind(source)
        .and_then(|k| all.get(k).cloned())
        .unwrap_or_default()
}

/// The field managers other than ours that own a field under `spec.source`.
fn source_managers(volume: &SealedVolume) -> Vec<String> {
    other_managers(volume, &["f:spec", "f:source"])
}

/// The field managers other than ours whose managed fields (`fieldsV1`) hold `path`, e.g.
/// `["f:spec", "f:tags", "f:prod"]`: who would lose a field if we took it.
pub(crate) fn other_managers(volume: &SealedVolume, path: &[&str]) -> Vec<String> {
    let mut owners: Vec<String> = volume
        .managed_fields()
        .iter()
        .filter(|m| m.manager.as_deref() != Some(FIELD_MANAGER))
        .filter(|m| {
            m.fields_v1.as_ref().is_some_and(|f| {
                path.iter()
                    .try_fold(&f.0, |node, key| node.get(*key))
                    .is_some()
            })
        })
        .filter_map(|m| m.manager.clone())
        .collect();
    owners.sort();
    owners.dedup();
    owners
}

/// The managers an apply conflict names: `conflict with "argocd-controller" using …`
/// (`conflicts with` when it owns several of the fields).
fn conflicting_managers(message: &str) -> Vec<String> {
    let mut owners: Vec<String> = message
        .split(" with \"")
        .skip(1)
        .filter_map(|rest| rest.split_once('"').map(|(m, _)| m))
        .filter(|m| !m.is_empty() && m.len() <= 128)
        .map(str::to_owned)
        .collect();
    owners.sort();
    owners.dedup();
    owners
}

fn finish(ctx: &Context, result: &SyncResult, code: ExitCode) -> anyhow::Result<ExitCode> {
    if ctx.json() {
        print_json(result)?;
    } else if let Some(d) = &result.digest {
        println!("{d}");
    } else {
        eprintln!("sync of {} into {} started", result.source, result.volume);
    }
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflicts_name_their_managers() {
        let message = "Apply failed with 2 conflicts: conflicts with \"argocd-controller\" \
                       using sealedvolumes.io/v1alpha1:\n- .spec.source.huggingFace.repo\n\
                       conflict with \"kubectl-client-side-apply\" using sealedvolumes.io/v1alpha1: \
                       .spec.source.huggingFace.revision";
        assert_eq!(
            conflicting_managers(message),
            ["argocd-controller", "kubectl-client-side-apply"]
        );
        assert!(conflicting_managers("no names here").is_empty());
        let refusal = owned_elsewhere("ml", "llama", "argocd-controller");
        assert!(refusal.contains("ml/llama") && refusal.contains("argocd-controller"));
        assert!(refusal.contains("--force"), "{refusal}");
    }

    #[test]
    fn a_source_has_one_kind() {
        let hf = Source::from_uri("hf://acme/llm").unwrap();
        assert_eq!(source_kind(&hf), Some("huggingFace"));
        assert_eq!(source_field(&hf)["repo"], "acme/llm");
        let s3 = Source::from_uri("s3://bucket/prefix").unwrap();
        assert_eq!(source_kind(&s3), Some("objectStore"));
        assert_eq!(source_kind(&Source::upload()), Some("upload"));
    }
}
