//! TLS between peers, with real `sealed mount` processes over moto: two nodes with
//! certificates of the fleet's CA serve each other; a third, in the same membership list and
//! with the same token but a certificate of another CA, gets nothing from them and serves
//! them nothing. Everybody still reads every byte right (the foreign node from the origin).

mod common;

use std::path::{Path, PathBuf};

use common::{Fleet, counter, peer_counter, ports, read_everywhere};
use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};

/// The fleet name of the certificates (the default of `--peer-tls-name`).
const NAME: &str = "sealed-peer";

struct Ca {
    pem: String,
    issuer: Issuer<'static, KeyPair>,
}

fn ca() -> Ca {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let key = KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    Ca {
        pem: cert.pem(),
        issuer: Issuer::new(params, key),
    }
}

/// Writes a certificate for the fleet name under `ca` (server and client use), its key and
/// the CA into `dir`; returns the three `--peer-tls-*` flags.
fn tls_flags(ca: &Ca, dir: &Path) -> Vec<String> {
    let mut params = CertificateParams::new(vec![NAME.to_owned()]).unwrap();
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &ca.issuer).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    let write = |name: &str, pem: &str| -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, pem).unwrap();
        path
    };
    let files = [
        ("--peer-tls-cert", write("tls.crt", &cert.pem())),
        ("--peer-tls-key", write("tls.key", &key.serialize_pem())),
        ("--peer-tls-ca", write("ca.crt", &ca.pem)),
    ];
    files
        .iter()
        .map(|(flag, path)| format!("{flag}={}", path.display()))
        .collect()
}

#[test]
fn peers_of_the_fleet_ca_serve_each_other_and_a_foreign_certificate_gets_nothing() {
    let Some(fleet) = Fleet::start(2, 16) else {
        return;
    };
    let (fleet_ca, foreign_ca) = (ca(), ca());
    let (ports, addrs) = ports(3);
    let peers = [format!("--peers={}", addrs.join(","))];
    let flags: Vec<Vec<String>> = (0..3)
        .map(|i| {
            let ca = if i < 2 { &fleet_ca } else { &foreign_ca };
            tls_flags(ca, &fleet.work.path().join(format!("tls-{i}")))
        })
        .collect();
    let nodes: Vec<_> = (0..3)
        .map(|i| {
            let extra: Vec<&str> = flags[i].iter().map(String::as_str).collect();
            fleet.node(i, ports[i], &peers, &extra)
        })
        .collect();
    for wrong in read_everywhere(&fleet, &nodes) {
        assert_eq!(wrong, Vec::<String>::new(), "wrong bytes read");
    }
    let stats: Vec<_> = nodes.into_iter().map(|n| n.stop()).collect();
    for s in &stats {
        assert_eq!(counter(s, "read_errors"), 0, "a reader saw an error: {s}");
        assert_eq!(counter(s, "peer_corrupt"), 0, "{s}");
    }
    let (good, foreign) = (&stats[..2], &stats[2]);
    for s in good {
        // Over TLS, the two nodes of the fleet CA asked each other and were answered.
        assert!(
            counter(s, "peer_bytes_fetched") > 0,
            "a node of the fleet got nothing from its peer over TLS: {s}"
        );
        assert!(
            peer_counter(s, "served_requests") > 0,
            "a node of the fleet served nothing over TLS: {s}"
        );
        // The foreign node asked it for the chunks it owns: its handshakes were refused.
        assert!(
            peer_counter(s, "tls_refused") > 0,
            "the foreign node's handshakes were not refused here: {s}"
        );
    }
    // The foreign node trusts only its own CA, so it refused the fleet's servers (its asks
    // failed) and they refused it: not one chunk either way.
    assert_eq!(
        counter(foreign, "peer_bytes_fetched"),
        0,
        "the foreign node got chunks from the fleet: {foreign}"
    );
    assert_eq!(
        peer_counter(foreign, "served_requests"),
        0,
        "the foreign node served the fleet: {foreign}"
    );
    assert!(
        peer_counter(foreign, "request_failures") + peer_counter(foreign, "skipped_down") > 0,
        "the foreign node never tried the fleet's servers: {foreign}"
    );
    assert!(
        counter(foreign, "store_bytes_fetched") >= fleet.version_bytes(),
        "the foreign node did not read the whole version from the origin: {foreign}"
    );
}
