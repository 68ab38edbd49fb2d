//! `sealed tag VOLUME TAG DIGEST`: point a tag of a SealedVolume at one of its versions;
//! `sealed tag --rm VOLUME TAG`: remove the tag.
//!
//! Tags live in the cluster (`spec.tags` of the SealedVolume), where the admission webhook
//! resolves them once per workload revision and tag-following workloads roll on their move
//! (docs/csi.md, "Tags and rollouts"). The digest must be a version of the volume (a
//! `SealedVolumeVersion` whose `spec.volume` is it): a tag naming anything else would only
//! refuse pods, so it is refused here, as the webhook would refuse it. A short digest is
//! looked up among the volume's versions.
//!
//! A tag someone else wrote (another field manager: Git through Argo CD or Flux, `kubectl
//! apply`) is not changed behind its back: `--force` takes it over, as `sealed sync --force`
//! takes a source over. The change is one merge patch conditional on the resourceVersion
//! that was read, so a concurrent change is reported, not overwritten.

use std::process::ExitCode;

use anyhow::{Context as _, bail};
use clap::Args;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};
use sealed_crds::{SealedVolume, SealedVolumeVersion};

use crate::commands::sync::{FIELD_MANAGER, other_managers};
use crate::context::pick_digest;
use crate::errors::{NotFoundError, UsageError};
use crate::output::print_json;

#[derive(Args, Debug)]
pub struct TagArgs {
    /// The SealedVolume, NAME or NAMESPACE/NAME
    pub volume: String,
    /// The tag to set or (with --rm) remove
    pub tag: String,
    /// The version to point the tag at: a digest, or the start of one (at least 8 hex
    /// digits) that exactly one version of the volume starts with
    #[arg(required_unless_present = "rm", conflicts_with = "rm")]
    pub digest: Option<String>,
    /// Remove the tag instead of setting it
    #[arg(long)]
    pub rm: bool,
    /// Change a tag another field manager wrote (Git, through Argo CD, Flux or `kubectl
    /// apply`); the next GitOps sync may put Git's value back
    #[arg(long)]
    pub force: bool,
    #[command(flatten)]
    pub kube: crate::kube_args::KubeArgs,
}

/// Patches tried before a volume that keeps changing is reported.
const CONFLICT_ATTEMPTS: u32 = 8;

#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct TagResult {
    volume: String,
    tag: String,
    /// What the tag names now (`None`: removed).
    digest: Option<String>,
    /// What it named before (`None`: a new tag).
    previous: Option<String>,
}

pub async fn run(ctx: &crate::context::Context, args: TagArgs) -> anyhow::Result<ExitCode> {
    if !sealed_crds::validate::is_tag_name(&args.tag) {
        return Err(UsageError(format!(
            "tag {:?}: {}",
            args.tag,
            sealed_crds::validate::TAG_NAME_HELP
        ))
        .into());
    }
    let (client, default_ns) = args.kube.client().await?;
    let (namespace, name) = args
        .volume
        .split_once('/')
        .unwrap_or((default_ns.as_str(), args.volume.as_str()));
    if namespace.is_empty() || name.is_empty() || name.contains('/') {
        return Err(UsageError(format!(
            "volume {:?} must be NAME or NAMESPACE/NAME",
            args.volume
        ))
        .into());
    }
    let full = format!("{namespace}/{name}");
    let volumes: Api<SealedVolume> = Api::namespaced(client.clone(), namespace);
    let digest = match &args.digest {
        Some(arg) => Some(version_digest(&client, namespace, name, arg).await?),
        None => None,
    };
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    };
    // The operator writes the volume's status (a new resourceVersion) as tags move: a patch
    // conditional on the one read is tried again on a conflict, reading and checking anew.
    let mut attempt = 0u32;
    let previous = loop {
        attempt += 1;
        let volume = volumes
            .get_opt(name)
            .await
            .with_context(|| format!("cannot read SealedVolume {full}"))?
            .ok_or_else(|| NotFoundError(format!("SealedVolume {full} not found")))?;
        let previous = volume.spec.tags.get(&args.tag).cloned();
        if args.rm && previous.is_none() {
            return Err(
                NotFoundError(format!("SealedVolume {full} has no tag {:?}", args.tag)).into(),
            );
        }
        if previous == digest {
            break previous;
        }
        let owners = tag_managers(&volume, &args.tag);
        if !owners.is_empty() && !args.force {
            bail!(
                "tag {} of SealedVolume {full} is managed by {} (Git, through a GitOps tool or \
                 kubectl apply): change it where it is kept, or run again with --force to take \
                 it over (the next GitOps sync may put it back)",
                args.tag,
                owners.join(", ")
            );
        }
        let patch = serde_json::json!({
            "metadata": { "resourceVersion": volume.resource_version() },
            "spec": { "tags": { args.tag.as_str(): digest } },
        });
        match volumes.patch(name, &params, &Patch::Merge(&patch)).await {
            Ok(_) => break previous,
            Err(kube::Error::Api(e)) if e.code == 409 && attempt < CONFLICT_ATTEMPTS => {
                tokio::time::sleep(std::time::Duration::from_millis(100 * u64::from(attempt)))
                    .await;
            }
            Err(kube::Error::Api(e)) if e.code == 409 => {
                bail!("SealedVolume {full} kept changing while its tag was set; run again")
            }
            Err(e) => {
                return Err(e).with_context(|| format!("cannot update SealedVolume {full}"));
            }
        }
    };
    let result = TagResult {
        volume: full,
        tag: args.tag,
        digest,
        previous,
    };
    if ctx.json() {
        print_json(&result)?;
    } else {
        let was = result.previous.as_deref().unwrap_or("nothing");
        match &result.digest {
            Some(d) if result.previous.as_ref() == Some(d) => {
                eprintln!("{} tag {} already names {d}", result.volume, result.tag)
            }
            Some(d) => eprintln!("{} tag {}: {was} -> {d}", result.volume, result.tag),
            None => eprintln!("{} tag {} removed (was {was})", result.volume, result.tag),
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The digest `arg` names among the versions of volume `namespace/name`: the one a whole
/// digest names, or the one a prefix names; an error when no version of the volume has it.
async fn version_digest(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    arg: &str,
) -> anyhow::Result<String> {
    let versions: Api<SealedVolumeVersion> = Api::namespaced(client.clone(), namespace);
    let listed = versions
        .list(&ListParams::default().fields(&format!("spec.volume={name}")))
        .await
        .with_context(|| format!("cannot list the SealedVolumeVersions of {namespace}/{name}"))?;
    let digests: Vec<sealed_store::Digest> = listed
        .items
        .iter()
        .filter(|v| v.spec.volume == name)
        .filter_map(|v| sealed_store::Digest::parse(&v.spec.digest).ok())
        .collect();
    let place = format!("of SealedVolume {namespace}/{name}");
    let digest = pick_digest(arg, || digests.clone(), &place)?;
    if !digests.contains(&digest) {
        return Err(NotFoundError(format!(
            "{digest} is no version of SealedVolume {namespace}/{name} (a pushed version \
             appears once the operator imports it: `kubectl get sealedvolumeversions -n \
             {namespace}`); a tag may only name one of its versions"
        ))
        .into());
    }
    Ok(digest.to_string())
}

/// The field managers other than ours that own `spec.tags.<tag>`.
fn tag_managers(volume: &SealedVolume, tag: &str) -> Vec<String> {
    let key = format!("f:{tag}");
    other_managers(volume, &["f:spec", "f:tags", &key])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_is_owned_by_whoever_wrote_it() {
        let v: SealedVolume = serde_json::from_value(serde_json::json!({
            "apiVersion": "sealedvolumes.io/v1alpha1", "kind": "SealedVolume",
            "metadata": {"name": "llama", "managedFields": [
                {"manager": "argocd-controller", "operation": "Apply", "apiVersion": "sealedvolumes.io/v1alpha1",
                 "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:tags": {"f:prod": {}}}}},
                {"manager": "sealed", "operation": "Update", "apiVersion": "sealedvolumes.io/v1alpha1",
                 "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:tags": {"f:canary": {}}}}},
            ]},
            "spec": {"source": {"upload": {}}},
        }))
        .unwrap();
        assert_eq!(tag_managers(&v, "prod"), ["argocd-controller"]);
        assert!(tag_managers(&v, "canary").is_empty(), "ours");
        assert!(tag_managers(&v, "new").is_empty());
    }
}
