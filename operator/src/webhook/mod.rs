//! The operator's mutating admission webhook for pods (docs/csi.md, "Tags and rollouts" and
//! "Where pods can mount"): a tag is resolved once per workload revision and the pod's volume
//! rewritten to that digest (`pods`, `revision`); pods with sealed volumes are kept off nodes
//! without the node plugin (`placement`). The operator makes its own CA and serving
//! certificate and puts the CA into the MutatingWebhookConfiguration (`certs`); every replica
//! serves the webhook, leader or not (`server`).

pub mod certs;
pub mod follow;
pub mod placement;
pub mod pods;
pub mod revision;
pub mod server;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use kube::Client;

use placement::Exclusion;
use pods::PodAdmission;
use server::CertSlot;

/// What `--webhook-*` set.
#[derive(Clone, Debug)]
pub struct WebhookConfig {
    /// Where the webhook listens (HTTPS).
    pub addr: SocketAddr,
    /// The operator's namespace, where the certificate Secret lives.
    pub namespace: String,
    /// The Secret with the CA and the serving certificate.
    pub secret: String,
    /// The MutatingWebhookConfiguration whose `caBundle` the operator keeps.
    pub configuration: String,
    /// The names (DNS or IP) the serving certificate is for: the Service's names.
    pub names: Vec<String>,
    /// The GPU products the node plugin does not run on.
    pub exclusion: Exclusion,
}

/// Makes (or reads) the serving certificate, puts the CA into the webhook configuration,
/// binds the listener, and returns the task that serves and keeps the certificate fresh.
pub async fn start(
    client: Client,
    config: WebhookConfig,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let cert = certs::ensure(&client, &config.namespace, &config.secret, &config.names)
        .await
        .context("webhook certificate")?;
    let slot = CertSlot::new(&cert).map_err(anyhow::Error::msg)?;
    if !certs::patch_ca_bundle(&client, &config.configuration, &cert.ca_pem).await? {
        tracing::warn!(configuration = %config.configuration, "no MutatingWebhookConfiguration of that name: the API server does not call this webhook");
    }
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .with_context(|| format!("cannot listen on {} (--webhook-addr)", config.addr))?;
    let admission = Arc::new(PodAdmission {
        client: client.clone(),
        exclusion: config.exclusion.clone(),
    });
    let serving = tokio::spawn({
        let slot = slot.clone();
        async move {
            if let Err(e) = server::serve(listener, slot, admission).await {
                tracing::error!(error = %e, "the webhook stopped serving");
            }
        }
    });
    Ok(tokio::spawn(async move {
        let _serving = AbortOnDrop(serving);
        let mut served = cert;
        loop {
            tokio::time::sleep(certs::CHECK_INTERVAL).await;
            match refresh(&client, &config, &slot, &served).await {
                Ok(now) => served = now,
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "cannot check the webhook's certificate")
                }
            }
        }
    }))
}

/// One check: the Secret (renewed when expiring), the certificate served, the `caBundle`.
async fn refresh(
    client: &Client,
    config: &WebhookConfig,
    slot: &CertSlot,
    served: &certs::ServingCert,
) -> anyhow::Result<certs::ServingCert> {
    let cert = certs::ensure(client, &config.namespace, &config.secret, &config.names).await?;
    if cert != *served {
        slot.set(&cert).map_err(anyhow::Error::msg)?;
        tracing::info!("serving the webhook's new certificate");
    }
    certs::patch_ca_bundle(client, &config.configuration, &cert.ca_pem).await?;
    Ok(cert)
}

/// Stops a task when dropped (the serving task with the refresh task, the follower with the
/// leadership).
pub struct AbortOnDrop(pub tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
