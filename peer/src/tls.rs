//! TLS between peers (optional; without it peers speak h2c): every node presents one
//! certificate for the fleet's name, signed by the fleet's CA, as server and as client, and
//! accepts only peers that do the same (mTLS). The bearer token stays on top.
//!
//! Peers are dialled by pod IP, and pod IPs are not in any certificate, so both sides check
//! the peer's certificate against the fixed fleet name (`--peer-tls-name`), never the dialled
//! address. A CA shared with other services (a cluster-wide issuer) thus admits only
//! certificates for this fleet's name. The crypto provider is ring, given explicitly: kube
//! in this workspace uses ring, and a process-default provider panics when two are built in.
//!
//! The files are read at start and again when they change (`crate::reload`): a renewed
//! certificate or a new CA takes effect for new connections without restarting the node.

use std::fmt;
use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ResolvesClientCert, WebPkiServerVerifier, verify_server_name};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore,
    ServerConfig, SignatureScheme,
};

use crate::PeerError;

/// The fleet name certificates are for when `--peer-tls-name` is not given.
pub const DEFAULT_NAME: &str = "sealed-peer";
/// Bound on a TLS handshake on the peer port: a client that stalls it (slowloris) holds a
/// task and a socket this long at most.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most bytes read from one PEM file (a chain of a few certificates is a few KiB).
const MAX_PEM_BYTES: u64 = 1 << 20;
const ALPN_H2: &[u8] = b"h2";

/// A node's TLS for the peer tier: the server side (certificate, client certificates
/// required) and the client side (the same certificate, the fleet's CA and name). Cheap to
/// clone.
#[derive(Clone)]
pub struct PeerTls {
    name: String,
    fleet: ServerName<'static>,
    provider: Arc<CryptoProvider>,
    /// What the configs below read at each handshake; [`PeerTls::replace_pem`] swaps it.
    current: Shared,
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
}

type Shared = Arc<RwLock<Arc<Material>>>;

/// One generation of this node's certificate and the fleet's CA.
#[derive(Debug)]
struct Material {
    key: Arc<CertifiedKey>,
    server_verifier: Arc<WebPkiServerVerifier>,
    client_verifier: Arc<dyn ClientCertVerifier>,
}

fn load(current: &Shared) -> Arc<Material> {
    current.read().unwrap_or_else(|e| e.into_inner()).clone()
}

impl fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerTls")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl PeerTls {
    /// From the `--peer-tls-cert`, `--peer-tls-key` and `--peer-tls-ca` flags: `None` when
    /// none is given (h2c), an error when only some are.
    pub fn from_flags(
        cert: Option<&Path>,
        key: Option<&Path>,
        ca: Option<&Path>,
        name: &str,
    ) -> Result<Option<PeerTls>, PeerError> {
        match (cert, key, ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => PeerTls::from_files(cert, key, ca, name).map(Some),
            _ => Err(PeerError::Tls(
                "--peer-tls-cert, --peer-tls-key and --peer-tls-ca go together: give all three \
                 (TLS between peers) or none (h2c)"
                    .into(),
            )),
        }
    }

    /// From PEM files: this node's certificate chain (leaf first), its private key, and the
    /// fleet's CA certificates.
    pub fn from_files(
        cert: &Path,
        key: &Path,
        ca: &Path,
        name: &str,
    ) -> Result<PeerTls, PeerError> {
        let read = |what: &str, path: &Path| -> Result<Vec<u8>, PeerError> {
            let fail = |e: String| PeerError::Tls(format!("{what} {}: {e}", path.display()));
            let meta = std::fs::metadata(path).map_err(|e| fail(e.to_string()))?;
            if meta.len() > MAX_PEM_BYTES {
                return Err(fail(format!(
                    "{} bytes; a PEM file here has at most {MAX_PEM_BYTES}",
                    meta.len()
                )));
            }
            std::fs::read(path).map_err(|e| fail(e.to_string()))
        };
        let (cert_pem, key_pem, ca_pem) = (
            read("--peer-tls-cert", cert)?,
            read("--peer-tls-key", key)?,
            read("--peer-tls-ca", ca)?,
        );
        PeerTls::from_pem(&cert_pem, &key_pem, &ca_pem, name).map_err(|e| {
            PeerError::Tls(format!(
                "{e} (--peer-tls-cert {}, --peer-tls-key {}, --peer-tls-ca {})",
                cert.display(),
                key.display(),
                ca.display()
            ))
        })
    }

    /// From PEM text. Refuses a certificate that is not valid for `name` under the CA (every
    /// peer would refuse it); one outside its validity period is only logged (its renewal
    /// may be on the way, and until then this node reads from the origin).
    pub fn from_pem(cert: &[u8], key: &[u8], ca: &[u8], name: &str) -> Result<PeerTls, PeerError> {
        let tls = |e: String| PeerError::Tls(e);
        let fleet = ServerName::try_from(name.to_owned())
            .map_err(|e| tls(format!("--peer-tls-name {name:?} is not a DNS name: {e}")))?;
        if matches!(fleet, ServerName::IpAddress(_)) {
            return Err(tls(format!(
                "--peer-tls-name {name:?} is an address; it names the fleet (a DNS name in \
                 every peer's certificate)"
            )));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let current: Shared = Arc::new(RwLock::new(Arc::new(Material::parse(
            cert, key, ca, &fleet, name, &provider,
        )?)));

        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls(e.to_string()))?
            .with_client_cert_verifier(Arc::new(FleetClientVerifier {
                current: current.clone(),
                name: fleet.clone(),
            }))
            .with_cert_resolver(Arc::new(CurrentKey(current.clone())));
        server.alpn_protocols = vec![ALPN_H2.to_vec()];

        let mut client = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls(e.to_string()))?
            // The only custom part: the name checked is the fleet's, not the dialled IP.
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(FleetServerVerifier {
                current: current.clone(),
                name: fleet.clone(),
            }))
            .with_client_cert_resolver(Arc::new(CurrentKey(current.clone())));
        client.alpn_protocols = vec![ALPN_H2.to_vec()];

        Ok(PeerTls {
            name: name.to_owned(),
            fleet,
            provider,
            current,
            server: Arc::new(server),
            client: Arc::new(client),
        })
    }

    /// Replaces the certificate, key and CA for every new connection, both ways, after the
    /// same checks as at start; a refused set leaves the old one in place. Connections
    /// open already keep what they were made with.
    pub fn replace_pem(&self, cert: &[u8], key: &[u8], ca: &[u8]) -> Result<(), PeerError> {
        let material = Material::parse(cert, key, ca, &self.fleet, &self.name, &self.provider)?;
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(material);
        Ok(())
    }

    /// The fleet name peers' certificates are checked against.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.server.clone())
    }

    pub(crate) fn client_config(&self) -> ClientConfig {
        (*self.client).clone()
    }
}

/// A client config for h2c peers: reqwest's rustls backend builds one anyway, and without
/// this it would look for a process-default provider. No roots: it trusts no server.
pub(crate) fn plaintext_client_config() -> Result<ClientConfig, PeerError> {
    let provider: Arc<CryptoProvider> = Arc::new(rustls::crypto::ring::default_provider());
    Ok(ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| PeerError::Tls(e.to_string()))?
        .with_root_certificates(RootCertStore::empty())
        .with_no_client_auth())
}

impl Material {
    fn parse(
        cert: &[u8],
        key: &[u8],
        ca: &[u8],
        fleet: &ServerName<'static>,
        name: &str,
        provider: &Arc<CryptoProvider>,
    ) -> Result<Material, PeerError> {
        let tls = |e: String| PeerError::Tls(e);
        let chain = CertificateDer::pem_slice_iter(cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| tls(format!("the certificate is not PEM: {e}")))?;
        if chain.is_empty() {
            return Err(tls("the certificate file has no CERTIFICATE".into()));
        }
        let key = PrivateKeyDer::from_pem_slice(key)
            .map_err(|e| tls(format!("the key is not a PEM private key: {e}")))?;
        let mut roots = RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(ca) {
            let ca = ca.map_err(|e| tls(format!("the CA is not PEM: {e}")))?;
            roots
                .add(ca)
                .map_err(|e| tls(format!("the CA certificate is unusable: {e}")))?;
        }
        if roots.is_empty() {
            return Err(tls("the CA file has no CERTIFICATE".into()));
        }
        let roots = Arc::new(roots);
        let server_verifier =
            WebPkiServerVerifier::builder_with_provider(roots.clone(), provider.clone())
                .build()
                .map_err(|e| tls(format!("the CA: {e}")))?;
        check_own(&server_verifier, &chain, fleet, name)?;
        let client_verifier = WebPkiClientVerifier::builder_with_provider(roots, provider.clone())
            .build()
            .map_err(|e| tls(format!("the CA: {e}")))?;
        let key = CertifiedKey::from_der(chain, key, provider)
            .map_err(|e| tls(format!("the certificate and key: {e}")))?;
        Ok(Material {
            key: Arc::new(key),
            server_verifier,
            client_verifier,
        })
    }
}

/// This node's current certificate, presented as server and as client.
#[derive(Debug)]
struct CurrentKey(Shared);

impl ResolvesServerCert for CurrentKey {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(load(&self.0).key.clone())
    }
}

impl ResolvesClientCert for CurrentKey {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(load(&self.0).key.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// This node's own certificate, checked as a peer would check it.
fn check_own(
    verifier: &WebPkiServerVerifier,
    chain: &[CertificateDer<'static>],
    fleet: &ServerName<'static>,
    name: &str,
) -> Result<(), PeerError> {
    let (leaf, intermediates) = chain
        .split_first()
        .ok_or_else(|| PeerError::Tls("the certificate file has no CERTIFICATE".into()))?;
    match verifier.verify_server_cert(leaf, intermediates, fleet, &[], UnixTime::now()) {
        Ok(_) => Ok(()),
        Err(rustls::Error::InvalidCertificate(
            e @ (CertificateError::Expired
            | CertificateError::ExpiredContext { .. }
            | CertificateError::NotValidYet
            | CertificateError::NotValidYetContext { .. }),
        )) => {
            tracing::warn!(error = ?e, "this node's peer certificate is outside its validity \
                period: peers will refuse it and this node reads from the origin until it is \
                renewed");
            Ok(())
        }
        Err(e) => Err(PeerError::Tls(format!(
            "this node's certificate would be refused by its peers (it must chain to the CA \
             and be for --peer-tls-name {name:?}, with server and client use): {e}"
        ))),
    }
}

/// rustls' WebPKI server verifier, given the fleet name instead of the dialled address.
#[derive(Debug)]
struct FleetServerVerifier {
    current: Shared,
    name: ServerName<'static>,
}

impl ServerCertVerifier for FleetServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _dialled: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        load(&self.current).server_verifier.verify_server_cert(
            end_entity,
            intermediates,
            &self.name,
            ocsp_response,
            now,
        )
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        load(&self.current)
            .server_verifier
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        load(&self.current)
            .server_verifier
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        load(&self.current)
            .server_verifier
            .supported_verify_schemes()
    }
}

/// rustls' WebPKI client verifier (chain to the CA, client use; a certificate required),
/// and then the fleet name, which it does not check: a CA shared with other services must
/// not let their certificates in.
#[derive(Debug)]
struct FleetClientVerifier {
    current: Shared,
    name: ServerName<'static>,
}

impl ClientCertVerifier for FleetClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    // No hints: the CA can change under a running server, and every node has only its one
    // certificate to offer anyway.
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = load(&self.current).client_verifier.verify_client_cert(
            end_entity,
            intermediates,
            now,
        )?;
        verify_server_name(&ParsedCertificate::try_from(end_entity)?, &self.name)?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        load(&self.current)
            .client_verifier
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        load(&self.current)
            .client_verifier
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        load(&self.current)
            .client_verifier
            .supported_verify_schemes()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rcgen::{CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};

    pub(crate) struct Ca {
        pub(crate) pem: String,
        issuer: Issuer<'static, KeyPair>,
    }

    pub(crate) fn ca() -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Ca {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// (certificate PEM, key PEM) for `name`, for server and client use.
    pub(crate) fn leaf(ca: &Ca, name: &str) -> (String, String) {
        let mut params = CertificateParams::new(vec![name.to_owned()]).unwrap();
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &ca.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    #[test]
    fn a_certificate_for_the_fleet_name_under_the_ca_loads() {
        let ca = ca();
        let (cert, key) = leaf(&ca, DEFAULT_NAME);
        let tls = PeerTls::from_pem(
            cert.as_bytes(),
            key.as_bytes(),
            ca.pem.as_bytes(),
            DEFAULT_NAME,
        )
        .unwrap();
        assert_eq!(tls.name(), DEFAULT_NAME);
        assert_eq!(tls.client_config().alpn_protocols, vec![b"h2".to_vec()]);
    }

    #[test]
    fn a_certificate_its_peers_would_refuse_is_refused_at_start() {
        let (ca, other) = (ca(), ca());
        let (cert, key) = leaf(&ca, "another-fleet");
        let e = PeerTls::from_pem(
            cert.as_bytes(),
            key.as_bytes(),
            ca.pem.as_bytes(),
            DEFAULT_NAME,
        )
        .unwrap_err();
        assert!(e.to_string().contains("would be refused"), "{e}");
        let (cert, key) = leaf(&ca, DEFAULT_NAME);
        let e = PeerTls::from_pem(
            cert.as_bytes(),
            key.as_bytes(),
            other.pem.as_bytes(),
            DEFAULT_NAME,
        )
        .unwrap_err();
        assert!(e.to_string().contains("would be refused"), "{e}");
        // The key of another certificate.
        let (_, wrong_key) = leaf(&ca, DEFAULT_NAME);
        assert!(
            PeerTls::from_pem(
                cert.as_bytes(),
                wrong_key.as_bytes(),
                ca.pem.as_bytes(),
                DEFAULT_NAME
            )
            .is_err()
        );
        assert!(PeerTls::from_pem(b"", key.as_bytes(), ca.pem.as_bytes(), DEFAULT_NAME).is_err());
        assert!(PeerTls::from_pem(cert.as_bytes(), key.as_bytes(), b"", DEFAULT_NAME).is_err());
        assert!(
            PeerTls::from_pem(
                cert.as_bytes(),
                key.as_bytes(),
                ca.pem.as_bytes(),
                "10.0.0.1"
            )
            .is_err()
        );
    }

    #[test]
    fn the_three_files_go_together_and_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ca();
        let (cert, key) = leaf(&ca, DEFAULT_NAME);
        let (c, k, a) = (
            dir.path().join("tls.crt"),
            dir.path().join("tls.key"),
            dir.path().join("ca.crt"),
        );
        std::fs::write(&c, cert).unwrap();
        std::fs::write(&k, key).unwrap();
        std::fs::write(&a, &ca.pem).unwrap();
        assert!(
            PeerTls::from_flags(None, None, None, DEFAULT_NAME)
                .unwrap()
                .is_none()
        );
        assert!(
            PeerTls::from_flags(Some(&c), Some(&k), Some(&a), DEFAULT_NAME)
                .unwrap()
                .is_some()
        );
        let e = PeerTls::from_flags(Some(&c), None, Some(&a), DEFAULT_NAME).unwrap_err();
        assert!(e.to_string().contains("go together"), "{e}");
        let missing = dir.path().join("nope.key");
        let e = PeerTls::from_flags(Some(&c), Some(&missing), Some(&a), DEFAULT_NAME).unwrap_err();
        assert!(e.to_string().contains("nope.key"), "{e}");
    }
}
