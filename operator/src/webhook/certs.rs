//! The webhook's TLS, made by the operator itself (no cert-manager), through the operator's
//! one home for the certificates it makes (`crate::fleet_pki`): a CA in Secret `<secret>-ca`
//! (only the operator reads it) and a serving certificate for the webhook Service's names in
//! Secret `<secret>` (`kubernetes.io/tls`), each made only when missing and the serving one
//! renewed with a third of its life left or when the CA changed; replicas that start together
//! agree on the first writer's (conditional create and update, read back). The CA goes into
//! the MutatingWebhookConfiguration's `caBundle`, so the API server trusts the certificate.
//! The operator checks every [`CHECK_INTERVAL`]: the Secrets, the `caBundle` (a `helm
//! upgrade` or a hand edit may drop it) and the certificate it serves.

use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use kube::api::PostParams;
use kube::{Api, Client};

use crate::fleet_pki::{self, LeafSpec, Usage};

/// Validity of the serving certificate.
pub const CERT_DAYS: u32 = 365;
/// How often the Secrets and the `caBundle` are checked.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error(transparent)]
    Pki(#[from] crate::error::Error),
    #[error("{what}: {source}")]
    Kube { what: String, source: kube::Error },
    #[error(
        "Secret {0} has no tls.crt, tls.key and ca.crt (a Secret the operator did not make is left alone: delete it)"
    )]
    Incomplete(String),
    #[error("{0} changed under every attempt to write it; try again")]
    Contended(String),
}

/// The serving certificate and key, and the CA that signed it (PEM).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServingCert {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

/// The serving certificate for `names` from Secret `namespace/name`, made or renewed first
/// when needed (see the module's text).
pub async fn ensure(
    client: &Client,
    namespace: &str,
    name: &str,
    names: &[String],
) -> Result<ServingCert, CertError> {
    let ca = fleet_pki::ensure_ca(
        client,
        namespace,
        &format!("{name}-ca"),
        "sealed-volumes webhook CA",
    )
    .await?;
    let spec = LeafSpec {
        dns_names: names.to_vec(),
        usage: Usage::Server,
        days: CERT_DAYS,
    };
    fleet_pki::ensure_leaf(
        client,
        namespace,
        name,
        &ca,
        &spec,
        "The pod admission webhook's serving certificate (docs/csi.md); renewed by the \
         operator. Deleting it (or its -ca Secret) makes the operator issue new ones.",
    )
    .await?;
    let secret = Api::<Secret>::namespaced(client.clone(), namespace)
        .get(name)
        .await
        .map_err(|source| CertError::Kube {
            what: format!("reading Secret {namespace}/{name}"),
            source,
        })?;
    let text = |k: &str| fleet_pki::secret_text(&secret, k).map(str::to_owned);
    match (text("ca.crt"), text("tls.crt"), text("tls.key")) {
        (Some(ca_pem), Some(cert_pem), Some(key_pem)) => Ok(ServingCert {
            ca_pem,
            cert_pem,
            key_pem,
        }),
        _ => Err(CertError::Incomplete(format!("{namespace}/{name}"))),
    }
}

/// Puts `ca_pem` into the `caBundle` of every webhook of MutatingWebhookConfiguration `name`
/// that lacks it; `Ok(false)` when the configuration does not exist (the chart may have the
/// webhook off).
pub async fn patch_ca_bundle(client: &Client, name: &str, ca_pem: &str) -> Result<bool, CertError> {
    let api = Api::<MutatingWebhookConfiguration>::all(client.clone());
    let what = || format!("MutatingWebhookConfiguration {name}");
    for _ in 0..5 {
        let Some(mut config) = api.get_opt(name).await.map_err(|source| CertError::Kube {
            what: format!("reading {}", what()),
            source,
        })?
        else {
            return Ok(false);
        };
        let bundle = ByteString(ca_pem.as_bytes().to_vec());
        let mut changed = false;
        for hook in config.webhooks.iter_mut().flatten() {
            if hook.client_config.ca_bundle.as_ref() != Some(&bundle) {
                hook.client_config.ca_bundle = Some(bundle.clone());
                changed = true;
            }
        }
        if !changed {
            return Ok(true);
        }
        match api.replace(name, &PostParams::default(), &config).await {
            Ok(_) => {
                tracing::info!(configuration = name, "put the webhook CA into caBundle");
                return Ok(true);
            }
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(source) => {
                return Err(CertError::Kube {
                    what: format!("updating {}", what()),
                    source,
                });
            }
        }
    }
    Err(CertError::Contended(what()))
}
