//! Transport C's certificates: a CA and a certificate for the fleet name under it for each
//! side, as an operator would issue them (docs/peer.md, "TLS"). Everything past the PEM is
//! the tier's own `PeerTls::from_pem`, which checks the fleet name on both ends.

use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};
use sealed_peer::PeerTls;
use serde::{Deserialize, Serialize};

/// The fleet name in both certificates (the tier's default `--peer-tls-name`).
pub const NAME: &str = sealed_peer::tls::DEFAULT_NAME;

/// One side's certificate and key, and the CA both trust (PEM).
#[derive(Serialize, Deserialize, Clone)]
pub struct Side {
    pub cert: String,
    pub key: String,
    pub ca: String,
}

impl Side {
    pub fn peer_tls(&self) -> anyhow::Result<PeerTls> {
        Ok(PeerTls::from_pem(
            self.cert.as_bytes(),
            self.key.as_bytes(),
            self.ca.as_bytes(),
            NAME,
        )?)
    }
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
