//! The kubectl flags of every command that talks to the cluster, resolved as kubectl
//! resolves them: `--kubeconfig FILE` (else `$KUBECONFIG`, else `~/.kube/config`, else the
//! in-cluster service account), `--context NAME` (else the file's current-context), and
//! `-n/--namespace` (else the context's namespace, else `default`).

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

#[derive(Args, Debug, Clone, Default)]
pub struct KubeArgs {
    /// Namespace (default: the kubeconfig context's, else "default")
    #[arg(short = 'n', long)]
    pub namespace: Option<String>,
    /// Kubeconfig context to use (default: its current-context)
    #[arg(long = "context", value_name = "NAME")]
    pub kube_context: Option<String>,
    /// Kubeconfig file (default: $KUBECONFIG, else ~/.kube/config, else in-cluster)
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
}

impl KubeArgs {
    /// The client configuration, with `-n` as its default namespace.
    pub async fn config(&self) -> anyhow::Result<Config> {
        let options = KubeConfigOptions {
            context: self.kube_context.clone(),
            ..Default::default()
        };
        let mut config = match (&self.kubeconfig, &self.kube_context) {
            (Some(path), _) => {
                let file = Kubeconfig::read_from(path)
                    .with_context(|| format!("cannot read --kubeconfig {}", path.display()))?;
                Config::from_custom_kubeconfig(file, &options)
                    .await
                    .with_context(|| format!("cannot use --kubeconfig {}", path.display()))?
            }
            // A named context lives in a kubeconfig: no in-cluster fallback.
            (None, Some(name)) => Config::from_kubeconfig(&options)
                .await
                .with_context(|| format!("cannot use kubeconfig context {name:?}"))?,
            (None, None) => Config::infer().await.context(
                "no Kubernetes configuration: set --kubeconfig or KUBECONFIG, or run in a pod",
            )?,
        };
        if let Some(ns) = self.namespace.as_ref().filter(|ns| !ns.is_empty()) {
            config.default_namespace = ns.clone();
        }
        Ok(config)
    }

    /// A client and the namespace to work in.
    pub async fn client(&self) -> anyhow::Result<(Client, String)> {
        let config = self.config().await?;
        let namespace = config.default_namespace.clone();
        let client = Client::try_from(config).context(
            "cannot reach the Kubernetes API server (check --kubeconfig, --context, KUBECONFIG)",
        )?;
        Ok((client, namespace))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KUBECONFIG: &str = r#"
apiVersion: v1
kind: Config
current-context: a
clusters:
- name: ca
  cluster: {server: "https://127.0.0.1:1"}
- name: cb
  cluster: {server: "https://127.0.0.2:2"}
users:
- name: u
  user: {token: t}
contexts:
- name: a
  context: {cluster: ca, user: u, namespace: from-a}
- name: b
  context: {cluster: cb, user: u}
"#;

    #[tokio::test]
    async fn resolved_like_kubectl() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config");
        std::fs::write(&file, KUBECONFIG).unwrap();
        let args = |ctx: Option<&str>, ns: Option<&str>| KubeArgs {
            namespace: ns.map(Into::into),
            kube_context: ctx.map(Into::into),
            kubeconfig: Some(file.clone()),
        };
        let c = args(None, None).config().await.unwrap();
        assert_eq!(c.cluster_url.port_u16(), Some(1));
        assert_eq!(c.default_namespace, "from-a");
        let c = args(Some("b"), None).config().await.unwrap();
        assert_eq!(c.cluster_url.port_u16(), Some(2));
        assert_eq!(c.default_namespace, "default");
        let c = args(Some("b"), Some("ml")).config().await.unwrap();
        assert_eq!(c.default_namespace, "ml");
        let err = args(Some("nope"), None).config().await.unwrap_err();
        assert!(format!("{err:#}").contains("nope"), "{err:#}");
    }
}
