//! The Job executor: each sync is a Kubernetes Job in the operator's namespace running
//! `sealed-operator sync`. The Job gets the store's credentials (the operator's store Secret,
//! under the [`STORE_CREDENTIAL_ENV_PREFIX`] prefix, which no source reader reads) and the
//! source's (a Secret of its own, owned by the Job, so it goes when the Job does), the
//! operator's source policy as arguments (the sync checks it again), no Kubernetes API access,
//! and reports its outcome as JSON in its termination message.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{
    Job, JobSpec, PodFailurePolicy, PodFailurePolicyOnExitCodesRequirement, PodFailurePolicyRule,
};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, EnvFromSource, EnvVar, Pod, PodSecurityContext, PodSpec,
    PodTemplateSpec, ResourceRequirements, Secret, SecretEnvSource, SecurityContext,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{ListParams, PostParams};
use kube::{Api, Client};
use sealed_store::STORE_CREDENTIAL_ENV_PREFIX;

use super::{SourceCredentials, SyncFailure, SyncRequest, SyncState, Termination};
use crate::config::OperatorConfig;
use crate::error::{Error, Result};

/// Exit code of `sealed-operator sync` for failures a retry cannot fix (missing repo, bad
/// credentials): the Job's pod failure policy fails the Job at once instead of retrying.
pub const EXIT_PERMANENT: i32 = 3;

pub const LABEL_VOLUME_NAMESPACE: &str = "sealedvolumes.io/volume-namespace";
pub const LABEL_VOLUME_NAME: &str = "sealedvolumes.io/volume-name";
pub const ANNOTATION_TRIGGER: &str = "sealedvolumes.io/trigger";
const CONTAINER: &str = "sync";

pub struct JobExecutor {
    client: Client,
    config: OperatorConfig,
}

impl JobExecutor {
    pub fn new(client: Client, config: OperatorConfig) -> Self {
        JobExecutor { client, config }
    }

    fn jobs(&self) -> Api<Job> {
        Api::namespaced(self.client.clone(), &self.config.namespace)
    }

    /// The Job of one sync: `sync-<volume>-<hash of namespace, name and trigger>`, at most
    /// 63 characters (Job names become pod labels).
    pub fn job_name(request: &SyncRequest) -> String {
        let id = format!("{}/{}/{}", request.namespace, request.name, request.trigger);
        let hash = sealed_store::Digest::of(id.as_bytes()).hex();
        let name: String = request.name.chars().take(40).collect();
        format!("sync-{}-{}", name.trim_end_matches(['-', '.']), &hash[..12])
    }

    /// Creates the Job (and its credentials Secret). Creating it again is a no-op.
    pub async fn start(
        &self,
        request: &SyncRequest,
        credentials: &SourceCredentials,
    ) -> Result<String> {
        let name = Self::job_name(request);
        let job = job_spec(
            &self.config,
            request,
            &name,
            !credentials.to_env().is_empty(),
        )?;
        let created = match self.jobs().create(&PostParams::default(), &job).await {
            Ok(job) => job,
            Err(kube::Error::Api(e)) if e.code == 409 => self.jobs().get(&name).await?,
            Err(e) => return Err(e.into()),
        };
        let env = credentials.to_env();
        if !env.is_empty() {
            let owner = OwnerReference {
                api_version: "batch/v1".into(),
                kind: "Job".into(),
                name: name.clone(),
                uid: created.metadata.uid.clone().unwrap_or_default(),
                controller: Some(true),
                block_owner_deletion: Some(true),
            };
            let secret = Secret {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    namespace: Some(self.config.namespace.clone()),
                    labels: Some(labels(request)),
                    owner_references: Some(vec![owner]),
                    ..Default::default()
                },
                string_data: Some(env),
                type_: Some("Opaque".into()),
                ..Default::default()
            };
            let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &self.config.namespace);
            match secrets.create(&PostParams::default(), &secret).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(name)
    }

    /// Where the Job of this sync stands; a finished Job's outcome comes from its pod's
    /// termination message.
    pub async fn state(&self, request: &SyncRequest) -> Result<SyncState> {
        let name = Self::job_name(request);
        let Some(job) = self.jobs().get_opt(&name).await? else {
            return Ok(SyncState::Unknown);
        };
        let condition = |type_: &str| {
            job.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == type_ && c.status == "True"))
        };
        let (complete, failed) = (condition("Complete"), condition("Failed"));
        if !complete && !failed {
            return Ok(SyncState::Running {
                job: Some(name),
                progress: None,
            });
        }
        let termination = self.termination(&name).await?;
        let result = match (termination, complete) {
            (Some(Termination::Succeeded(outcome)), true) => Ok(outcome),
            (Some(Termination::Failed(failure)), _) => Err(failure),
            (_, true) => Err(SyncFailure::new(
                "SyncOutputMissing",
                format!(
                    "sync Job {}/{name} succeeded without reporting a digest; see `kubectl logs -n {} job/{name}`",
                    self.config.namespace, self.config.namespace
                ),
            )),
            (_, false) => Err(SyncFailure::new(
                "SyncJobFailed",
                format!(
                    "sync Job {}/{name} failed; see `kubectl logs -n {} job/{name}`",
                    self.config.namespace, self.config.namespace
                ),
            )),
        };
        Ok(SyncState::Finished {
            job: Some(name),
            result,
        })
    }

    /// The newest termination message of the Job's pods that parses.
    async fn termination(&self, job: &str) -> Result<Option<Termination>> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.config.namespace);
        let list = pods
            .list(&ListParams::default().labels(&format!("batch.kubernetes.io/job-name={job}")))
            .await?;
        let mut found: Vec<(Option<String>, Termination)> = Vec::new();
        for pod in list.items {
            let statuses = pod
                .status
                .and_then(|s| s.container_statuses)
                .unwrap_or_default();
            for cs in statuses.into_iter().filter(|c| c.name == CONTAINER) {
                let Some(t) = cs.state.and_then(|s| s.terminated) else {
                    continue;
                };
                let Some(msg) = t.message else { continue };
                if let Ok(parsed) = serde_json::from_str::<Termination>(msg.trim()) {
                    let at = t.finished_at.map(|f| f.0.to_string());
                    found.push((at, parsed));
                }
            }
        }
        found.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(found.pop().map(|(_, t)| t))
    }
}

/// The Job of one sync (`name`), for the operator configured as `cfg`; `has_secret`: the
/// source's credentials Secret (named like the Job) exists.
fn job_spec(
    cfg: &OperatorConfig,
    request: &SyncRequest,
    name: &str,
    has_secret: bool,
) -> Result<Job> {
    let source = serde_json::to_string(&request.source).map_err(|e| Error::Invalid {
        object: request.volume(),
        message: format!("cannot encode spec.source: {e}"),
    })?;
    let mut args = vec![
        "sync".to_string(),
        "--volume".into(),
        request.volume(),
        "--source".into(),
        source,
        "--trigger".into(),
        request.trigger.clone(),
        "--store".into(),
        cfg.store_url.clone(),
    ];
    if let Some(endpoint) = &cfg.store_options.endpoint {
        args.extend(["--store-endpoint".into(), endpoint.clone()]);
    }
    if let Some(region) = &cfg.store_options.region {
        args.extend(["--store-region".into(), region.clone()]);
    }
    // The sync checks the source against the same policy again (defence in depth).
    args.extend(request.policy.to_args());
    let mut env_from = Vec::new();
    if let Some(secret) = &cfg.store_secret {
        // Prefixed, so no source reader (which reads only SEALED_SOURCE_* and, for an
        // allow-listed source, AWS_/AZURE_/GOOGLE_*) ever sees the store's credentials;
        // ChunkStore::connect applies them to the store alone.
        env_from.push(secret_env(secret, Some(STORE_CREDENTIAL_ENV_PREFIX)));
    }
    if has_secret {
        env_from.push(secret_env(name, None));
    }
    let r = &cfg.sync_resources;
    let quantities = |cpu: &Option<String>, mem: &Option<String>| {
        let mut m = BTreeMap::new();
        if let Some(c) = cpu {
            m.insert("cpu".to_string(), Quantity(c.clone()));
        }
        if let Some(v) = mem {
            m.insert("memory".to_string(), Quantity(v.clone()));
        }
        (!m.is_empty()).then_some(m)
    };
    let container = Container {
        name: CONTAINER.into(),
        image: Some(cfg.sync_image.clone()),
        image_pull_policy: Some("IfNotPresent".into()),
        command: Some(vec!["sealed-operator".into()]),
        args: Some(args),
        // The operator's own log settings.
        env: Some(vec![
            EnvVar {
                name: sealed_service::logging::LOG_ENV.into(),
                value: Some(cfg.sync_log.filter.clone()),
                ..Default::default()
            },
            EnvVar {
                name: sealed_service::logging::LOG_JSON_ENV.into(),
                value: Some(cfg.sync_log.json.to_string()),
                ..Default::default()
            },
        ]),
        env_from: Some(env_from),
        resources: Some(ResourceRequirements {
            requests: quantities(&r.cpu_request, &r.memory_request),
            limits: quantities(&r.cpu_limit, &r.memory_limit),
            ..Default::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Default::default()
            }),
            ..Default::default()
        }),
        termination_message_policy: Some("File".into()),
        ..Default::default()
    };
    let pod = &cfg.sync_pod;
    let mut annotations = BTreeMap::new();
    annotations.insert(ANNOTATION_TRIGGER.to_string(), request.trigger.clone());
    Ok(Job {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(cfg.namespace.clone()),
            labels: Some(labels(request)),
            annotations: Some(annotations),
            ..Default::default()
        },
        spec: Some(JobSpec {
            backoff_limit: Some(3),
            ttl_seconds_after_finished: Some(24 * 3600),
            pod_failure_policy: Some(PodFailurePolicy {
                rules: vec![PodFailurePolicyRule {
                    action: "FailJob".into(),
                    on_exit_codes: Some(PodFailurePolicyOnExitCodesRequirement {
                        container_name: Some(CONTAINER.into()),
                        operator: "In".into(),
                        values: vec![EXIT_PERMANENT],
                    }),
                    on_pod_conditions: None,
                }],
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels(request)),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    restart_policy: Some("Never".into()),
                    // A named service account is for workload identity (its cloud role),
                    // never for the API server: no token is mounted either way.
                    service_account_name: pod.service_account_name.clone(),
                    image_pull_secrets: (!pod.image_pull_secrets.is_empty())
                        .then(|| pod.image_pull_secrets.clone()),
                    node_selector: (!pod.node_selector.is_empty())
                        .then(|| pod.node_selector.clone()),
                    tolerations: (!pod.tolerations.is_empty()).then(|| pod.tolerations.clone()),
                    affinity: pod.affinity.clone(),
                    priority_class_name: pod.priority_class_name.clone(),
                    automount_service_account_token: Some(false),
                    enable_service_links: Some(false),
                    security_context: Some(PodSecurityContext {
                        run_as_non_root: Some(true),
                        run_as_user: Some(65532),
                        run_as_group: Some(65532),
                        ..Default::default()
                    }),
                    containers: vec![container],
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        ..Default::default()
    })
}

fn labels(request: &SyncRequest) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            "app.kubernetes.io/managed-by".to_string(),
            "sealed-operator".to_string(),
        ),
        (
            LABEL_VOLUME_NAMESPACE.to_string(),
            request.namespace.clone(),
        ),
        (LABEL_VOLUME_NAME.to_string(), request.name.clone()),
    ])
}

fn secret_env(name: &str, prefix: Option<&str>) -> EnvFromSource {
    EnvFromSource {
        secret_ref: Some(SecretEnvSource {
            name: name.into(),
            optional: Some(false),
        }),
        prefix: prefix.map(str::to_owned),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sealed_crds::{ObjectStoreSource, Source};
    use sealed_sources::SourcePolicy;

    /// A sync of `ml/llm` from a public bucket under `policy`.
    fn request(policy: SourcePolicy) -> SyncRequest {
        SyncRequest {
            namespace: "ml".into(),
            name: "llm".into(),
            source: Source::object_store(ObjectStoreSource {
                url: "s3://public-models/llm".into(),
                endpoint: None,
                region: None,
                credentials_secret_ref: None,
            }),
            trigger: "generation=1".into(),
            policy,
        }
    }

    #[test]
    fn store_credentials_are_prefixed_and_the_policy_is_passed() {
        let mut cfg = OperatorConfig::inline("s3://sealed-store/prod", "sealed-volumes");
        cfg.store_secret = Some("store-creds".into());
        cfg.sync_image = "sealed-operator:test".into();
        let request = request(SourcePolicy {
            allow_http: true,
            ambient_allowed: vec!["s3://public-models/".into()],
            ..SourcePolicy::for_store("s3://sealed-store/prod", None)
        });
        let job = job_spec(&cfg, &request, "sync-llm-x", true).unwrap();
        let container = &job.spec.unwrap().template.spec.unwrap().containers[0];
        let env_from = container.env_from.clone().unwrap();
        let store = env_from
            .iter()
            .find(|e| {
                e.secret_ref
                    .as_ref()
                    .is_some_and(|s| s.name == "store-creds")
            })
            .expect("store Secret");
        assert_eq!(store.prefix.as_deref(), Some("SEALED_STORE_CRED_"));
        let source = env_from
            .iter()
            .find(|e| {
                e.secret_ref
                    .as_ref()
                    .is_some_and(|s| s.name == "sync-llm-x")
            })
            .expect("source Secret");
        assert_eq!(source.prefix, None, "its keys carry SEALED_SOURCE_ already");
        let args = container.args.clone().unwrap();
        let after = |flag: &str| {
            args.iter()
                .position(|a| a == flag)
                .map(|i| args[i + 1].clone())
        };
        assert_eq!(after("--store").as_deref(), Some("s3://sealed-store/prod"));
        assert!(args.iter().any(|a| a == "--allow-http-sources"), "{args:?}");
        assert!(
            !args.iter().any(|a| a == "--allow-file-sources"),
            "{args:?}"
        );
        assert_eq!(
            after("--ambient-credentials-source").as_deref(),
            Some("s3://public-models/")
        );
    }

    #[test]
    fn pod_settings_and_log_settings_reach_the_job_pod() {
        let mut cfg = OperatorConfig::inline("s3://sealed-store/prod", "sealed-volumes");
        cfg.sync_pod = crate::config::SyncPodSettings::parse(
            r#"{"serviceAccountName": "sync-sa",
                "imagePullSecrets": [{"name": "registry"}],
                "nodeSelector": {"pool": "cpu"},
                "tolerations": [{"key": "dedicated", "operator": "Exists"}],
                "priorityClassName": "batch-low"}"#,
        )
        .unwrap();
        cfg.sync_log = crate::config::SyncLog {
            filter: "debug".into(),
            json: true,
        };
        let request = request(SourcePolicy::for_store("s3://sealed-store/prod", None));
        let job = job_spec(&cfg, &request, "sync-llm-x", false).unwrap();
        let pod = job.spec.unwrap().template.spec.unwrap();
        assert_eq!(pod.service_account_name.as_deref(), Some("sync-sa"));
        assert_eq!(
            pod.automount_service_account_token,
            Some(false),
            "a named service account still gets no API token"
        );
        assert_eq!(pod.image_pull_secrets.unwrap()[0].name, "registry");
        assert_eq!(
            pod.node_selector.unwrap().get("pool").map(String::as_str),
            Some("cpu")
        );
        assert_eq!(
            pod.tolerations.unwrap()[0].key.as_deref(),
            Some("dedicated")
        );
        assert_eq!(pod.priority_class_name.as_deref(), Some("batch-low"));
        let env = pod.containers[0].env.clone().unwrap();
        let value = |name: &str| {
            env.iter()
                .find(|e| e.name == name)
                .and_then(|e| e.value.clone())
        };
        assert_eq!(value("SEALED_LOG").as_deref(), Some("debug"));
        assert_eq!(value("SEALED_LOG_JSON").as_deref(), Some("true"));

        // Defaults: none of them set.
        let cfg = OperatorConfig::inline("s3://sealed-store/prod", "sealed-volumes");
        let pod = job_spec(&cfg, &request, "sync-llm-x", false)
            .unwrap()
            .spec
            .unwrap()
            .template
            .spec
            .unwrap();
        assert_eq!(pod.service_account_name, None);
        assert_eq!(pod.image_pull_secrets, None);
        assert_eq!(pod.node_selector, None);
    }

    #[test]
    fn a_typo_in_the_pod_settings_is_refused_with_the_field() {
        let err = crate::config::SyncPodSettings::parse(r#"{"serviceAccount": "x"}"#).unwrap_err();
        assert!(err.contains("unknown field `serviceAccount`"), "{err}");
        assert_eq!(
            crate::config::SyncPodSettings::parse("").unwrap(),
            crate::config::SyncPodSettings::default()
        );
    }
}
