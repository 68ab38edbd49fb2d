//! Transport C: HTTP/2 over mTLS, as the peer tier with `--peer-tls-*` (peer/src/tls.rs,
//! server::serve_tls): rustls on ring, TLS 1.3 or 1.2, ALPN h2, a certificate for the fleet
//! name under one CA on both sides, hyper's HTTP/2 server on each accepted TLS stream, and
//! TCP_NODELAY. The server makes the CA and both certificates and hands the client its part
//! in the ready line.

use std::sync::Arc;

use anyhow::Context;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;

/// The fleet name in both certificates (the peer tier's default `--peer-tls-name`).
pub const NAME: &str = "sealed-peer";

/// One side's certificate and key, and the CA both trust (PEM).
#[derive(Serialize, Deserialize, Clone)]
pub struct Side {
    pub cert: String,
    pub key: String,
    pub ca: String,
}

/// A CA and a certificate for the fleet name under it for each side.
pub fn make() -> anyhow::Result<(Side, Side)> {
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate()?;
    let ca_pem = ca_params.self_signed(&ca_key)?.pem();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = || -> anyhow::Result<Side> {
        let mut params = CertificateParams::new(vec![NAME.to_owned()])?;
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &issuer)?;
        Ok(Side {
            cert: cert.pem(),
            key: key.serialize_pem(),
            ca: ca_pem.clone(),
        })
    };
    Ok((leaf()?, leaf()?))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn parts(
    side: &Side,
) -> anyhow::Result<(
    Vec<CertificateDer<'static>>,
    PrivateKeyDer<'static>,
    RootCertStore,
)> {
    let chain = CertificateDer::pem_slice_iter(side.cert.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .context("certificate PEM")?;
    let key = PrivateKeyDer::from_pem_slice(side.key.as_bytes()).context("key PEM")?;
    let mut roots = RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(side.ca.as_bytes()) {
        roots.add(ca.context("CA PEM")?)?;
    }
    Ok((chain, key, roots))
}

pub fn server_config(side: &Side) -> anyhow::Result<ServerConfig> {
    let (chain, key, roots) = parts(side)?;
    let verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider()).build()?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

pub fn client_config(side: &Side) -> anyhow::Result<ClientConfig> {
    let (chain, key, roots) = parts(side)?;
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// Serves `router` over TLS on `listener` until the task is dropped.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    config: ServerConfig,
) -> anyhow::Result<()> {
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    loop {
        let (tcp, _) = listener.accept().await?;
        let _ = tcp.set_nodelay(true);
        let (acceptor, router) = (acceptor.clone(), router.clone());
        tokio::spawn(async move {
            let Ok(stream) = acceptor.accept(tcp).await else {
                return;
            };
            let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), TowerToHyperService::new(router))
                .await;
        });
    }
}

/// For h2c: reqwest's rustls backend builds a config anyway and would look for a
/// process-default provider (as peer/src/tls.rs's plaintext_client_config).
pub fn plaintext_client_config() -> anyhow::Result<ClientConfig> {
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(RootCertStore::empty())
        .with_no_client_auth())
}
