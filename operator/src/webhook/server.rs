//! The webhook's HTTPS listener: the connection gate every listener shares
//! (`sealed_service::listen`), rustls with a certificate that can be swapped while serving
//! (renewal needs no restart), and `POST /mutate-pods`.

use std::sync::{Arc, RwLock};

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use k8s_openapi::api::core::v1::Pod;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview};
use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use sealed_service::listen::{self, ConnLimits, Gate, Protocols};
use tokio::net::TcpListener;

use super::certs::ServingCert;
use super::pods::PodAdmission;

/// The path the MutatingWebhookConfiguration names.
pub const MUTATE_PODS_PATH: &str = "/mutate-pods";

/// The certificate being served; [`CertSlot::set`] replaces it for new handshakes.
#[derive(Debug)]
pub struct CertSlot {
    provider: Arc<CryptoProvider>,
    current: RwLock<Arc<CertifiedKey>>,
}

fn certified(provider: &CryptoProvider, cert: &ServingCert) -> Result<CertifiedKey, String> {
    let chain = CertificateDer::pem_slice_iter(cert.cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("the webhook certificate is not PEM: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(cert.key_pem.as_bytes())
        .map_err(|e| format!("the webhook key is not PEM: {e}"))?;
    CertifiedKey::from_der(chain, key, provider)
        .map_err(|e| format!("the webhook certificate and key: {e}"))
}

impl CertSlot {
    pub fn new(cert: &ServingCert) -> Result<Arc<CertSlot>, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let key = certified(&provider, cert)?;
        Ok(Arc::new(CertSlot {
            provider,
            current: RwLock::new(Arc::new(key)),
        }))
    }

    pub fn set(&self, cert: &ServingCert) -> Result<(), String> {
        let key = Arc::new(certified(&self.provider, cert)?);
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = key;
        Ok(())
    }
}

impl ResolvesServerCert for CertSlot {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        )
    }
}

async fn mutate_pods(
    State(admission): State<Arc<PodAdmission>>,
    Json(review): Json<AdmissionReview<Pod>>,
) -> Json<AdmissionReview<DynamicObject>> {
    let request: AdmissionRequest<Pod> = match review.try_into() {
        Ok(r) => r,
        Err(e) => return Json(AdmissionResponse::invalid(e.to_string()).into_review()),
    };
    Json(admission.admit(&request).await.into_review())
}

/// Serves the webhook on `listener` until the task is dropped.
pub async fn serve(
    listener: TcpListener,
    slot: Arc<CertSlot>,
    admission: Arc<PodAdmission>,
) -> Result<(), String> {
    let mut config = ServerConfig::builder_with_provider(slot.provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("webhook TLS: {e}"))?
        .with_no_client_auth()
        .with_cert_resolver(slot);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let router = Router::new()
        .route(MUTATE_PODS_PATH, post(mutate_pods))
        .with_state(admission);
    // The API servers are the only clients; HTTP/1.1 takes a connection per admission in
    // flight, so a burst of pod creations (a Deployment scaling up) needs room per source.
    let gate = Gate::new(
        "webhook",
        ConnLimits {
            max_connections: 256,
            max_per_source: 64,
            ..ConnLimits::metrics()
        },
    );
    listen::accept_loop(
        listener,
        gate.clone(),
        std::future::pending(),
        move |tcp, remote, admitted| {
            let (acceptor, router, gate) = (acceptor.clone(), router.clone(), gate.clone());
            async move {
                let _admitted = admitted;
                let Some(stream) = gate.handshake(remote, acceptor.accept(tcp)).await else {
                    return;
                };
                listen::serve_connection(stream, remote, router, &gate, Protocols::Http1AndH2c)
                    .await;
            }
        },
    )
    .await
    .map_err(|e| format!("webhook listener: {e}"))
}
