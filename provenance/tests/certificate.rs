//! Certificate mode with the reference implementation: `model_signing` 1.1.1 (PyPI, pinned in
//! hack/install-test-deps.sh) signs a directory with a signing certificate made here (rcgen:
//! a root CA, an intermediate, leaves with chosen names and validity), its CLI over SHA-256 and
//! its API over BLAKE3, and `verify_with_certificate` accepts them against the manifest of the
//! same tree. Every refusal names what failed: the wrong CA, the wrong identity, an expired
//! certificate (which one, and at what time), a changed file. Where the reference decides the
//! same question (an expired signing certificate, an expired CA), its verifier is run too, to
//! show both agree.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::SystemTime;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use sealed_provenance::{
    CertificatePolicy, CheckOptions, Error, Problem, ValidAt, verify_with_certificate,
    verify_with_key,
};
use sealed_store::chunker::ChunkParams;
use sealed_store::digest::Digest;
use sealed_store::manifest::{ChunkRef, Entry, EntryKind, FileEntry, Manifest};
use sha2::Digest as _;

const MODEL_SIGNING_VERSION: &str = "1.1.1";
const IDENTITY: &str = "release-bot@models.example";

/// The venv hack/install-test-deps.sh makes ($SEALED_MODEL_SIGNING_VENV overrides).
fn venv() -> PathBuf {
    if let Some(v) = std::env::var_os("SEALED_MODEL_SIGNING_VENV") {
        return PathBuf::from(v);
    }
    std::env::var_os("SEALED_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()))
                .join(".cache/sealed-volumes")
        })
        .join(format!("model-signing-{MODEL_SIGNING_VERSION}"))
}

/// The venv's bin/, or None: the test skips (fails under SEALED_REQUIRE_SERVERS=1).
fn reference() -> Option<PathBuf> {
    let bin = venv().join("bin");
    if bin.join("model_signing").is_file() {
        return Some(bin);
    }
    assert!(
        std::env::var("SEALED_REQUIRE_SERVERS").as_deref() != Ok("1"),
        "model_signing not installed (hack/install-test-deps.sh)"
    );
    eprintln!(
        "skipped: model_signing {MODEL_SIGNING_VERSION} not installed (hack/install-test-deps.sh)"
    );
    None
}

fn run(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().expect("spawn");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn date(y: i32, m: u8, d: u8) -> time::OffsetDateTime {
    rcgen::date_time_ymd(y, m, d)
}

struct Ca {
    pem: String,
    issuer: Issuer<'static, KeyPair>,
}

fn ca(cn: &str, from: (i32, u8, u8), to: (i32, u8, u8), parent: Option<&Ca>) -> Ca {
    let key = KeyPair::generate().expect("key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, cn);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = date(from.0, from.1, from.2);
    params.not_after = date(to.0, to.1, to.2);
    let cert = match parent {
        Some(p) => params.signed_by(&key, &p.issuer),
        None => params.self_signed(&key),
    }
    .expect("CA certificate");
    Ca {
        pem: cert.pem(),
        issuer: Issuer::new(params, key),
    }
}

/// A signing certificate and its key (PEM files in `dir`).
fn leaf(
    dir: &Path,
    name: &str,
    issuer: &Ca,
    email: &str,
    from: (i32, u8, u8),
    to: (i32, u8, u8),
) -> (PathBuf, PathBuf) {
    let key = KeyPair::generate().expect("key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, name);
    params.subject_alt_names = vec![SanType::Rfc822Name(email.try_into().expect("ia5"))];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::CodeSigning];
    params.not_before = date(from.0, from.1, from.2);
    params.not_after = date(to.0, to.1, to.2);
    let cert = params.signed_by(&key, &issuer.issuer).expect("leaf");
    let (k, c) = (
        dir.join(format!("{name}.key")),
        dir.join(format!("{name}.crt")),
    );
    std::fs::write(&k, key.serialize_pem()).expect("write");
    std::fs::write(&c, cert.pem()).expect("write");
    (k, c)
}

const FILES: [(&str, &[u8]); 3] = [
    ("config.json", b"{\"layers\": 2}\n"),
    ("tokenizer/vocab.txt", b"a\nb\nc\n"),
    ("weights.bin", b"0123456789abcdef"),
];

fn write_model(dir: &Path) {
    for (p, b) in FILES {
        let path = dir.join(p);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(path, b).expect("write");
    }
}

/// The sealed manifest of the model (as the sealer lays it out), with `changed` files'
/// contents replaced.
fn manifest(changed: &[(&str, &[u8])]) -> Manifest {
    let mut entries = vec![Entry {
        path: "tokenizer".into(),
        kind: EntryKind::Dir,
    }];
    for (p, b) in FILES {
        let b = changed.iter().find(|c| c.0 == p).map_or(b, |c| c.1);
        let digest = Digest::of(b);
        entries.push(Entry {
            path: p.into(),
            kind: EntryKind::File(FileEntry {
                executable: false,
                size: b.len() as u64,
                blake3: digest,
                chunks: vec![ChunkRef {
                    digest,
                    len: b.len() as u32,
                }],
            }),
        });
    }
    entries.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
    let m = Manifest {
        chunking: ChunkParams::default(),
        entries,
    };
    m.validate().expect("valid manifest");
    m
}

fn sha256_digests() -> CheckOptions {
    CheckOptions {
        ignore_paths: vec!["model.sig".into()],
        digests: Some(
            FILES
                .iter()
                .map(|(p, b)| ((*p).to_string(), sha2::Sha256::digest(b).to_vec()))
                .collect::<HashMap<_, _>>(),
        ),
    }
}

fn blake3_opts() -> CheckOptions {
    CheckOptions {
        ignore_paths: vec!["model.sig".into()],
        digests: None,
    }
}

/// model_signing's API signs `model` in certificate mode with BLAKE3 into `out`.
fn sign_blake3(bin: &Path, model: &Path, key: &Path, cert: &Path, chain: &[&Path], out: &Path) {
    let chain: Vec<String> = chain.iter().map(|c| c.display().to_string()).collect();
    let script = format!(
        "import model_signing\nfrom model_signing import hashing\n\
         model_signing.signing.Config().use_certificate_signer(private_key={key:?}, \
         signing_certificate={cert:?}, certificate_chain={chain:?})\
         .set_hashing_config(hashing.Config().use_file_serialization(hashing_algorithm='blake3')\
         .set_ignored_paths(paths=['model.sig'])).sign({model:?}, {out:?})\n",
        key = key.display().to_string(),
        cert = cert.display().to_string(),
        model = model.display().to_string(),
        out = out.display().to_string(),
    );
    let (ok, text) = run(Command::new(bin.join("python")).args(["-c", &script]));
    assert!(ok, "model_signing (certificate, blake3) failed: {text}");
}

/// model_signing's CLI (`sign certificate`, SHA-256).
fn sign_cli(bin: &Path, model: &Path, key: &Path, cert: &Path, chain: &[&Path], out: &Path) {
    let mut cmd = Command::new(bin.join("model_signing"));
    cmd.args(["sign", "certificate", "--private_key"])
        .arg(key)
        .arg("--signing_certificate")
        .arg(cert);
    for c in chain {
        cmd.arg("--certificate_chain").arg(c);
    }
    cmd.arg("--signature").arg(out).arg(model);
    let (ok, text) = run(&mut cmd);
    assert!(ok, "model_signing sign certificate failed: {text}");
}

/// model_signing's CLI verifier (SHA-256 signatures) with the CA bundle `ca`.
fn reference_verifies(bin: &Path, model: &Path, sig: &Path, ca: &Path) -> (bool, String) {
    run(Command::new(bin.join("model_signing"))
        .args(["verify", "certificate", "--signature"])
        .arg(sig)
        .arg("--certificate_chain")
        .arg(ca)
        .arg(model))
}

fn policy(ca_pem: &str, identities: &[&str], valid_at: ValidAt) -> CertificatePolicy {
    CertificatePolicy::from_pem(
        ca_pem.as_bytes(),
        identities.iter().map(|s| s.to_string()).collect(),
        valid_at,
    )
    .expect("policy")
}

struct Pki {
    dir: tempfile::TempDir,
    root: Ca,
    root_pem: PathBuf,
    inter: Ca,
    inter_pem: PathBuf,
}

fn pki() -> Pki {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = ca("Models Root CA", (2020, 1, 1), (2060, 1, 1), None);
    let inter = ca("Models Signing CA", (2020, 1, 1), (2050, 1, 1), Some(&root));
    let (root_pem, inter_pem) = (dir.path().join("root.pem"), dir.path().join("inter.pem"));
    std::fs::write(&root_pem, &root.pem).expect("write");
    std::fs::write(&inter_pem, &inter.pem).expect("write");
    Pki {
        dir,
        root,
        root_pem,
        inter,
        inter_pem,
    }
}

#[test]
fn model_signing_certificate_signatures_verify_blake3_and_sha256() {
    let Some(bin) = reference() else { return };
    let p = pki();
    let model = p.dir.path().join("m");
    write_model(&model);
    let (key, cert) = leaf(
        p.dir.path(),
        "release-bot",
        &p.inter,
        IDENTITY,
        (2024, 1, 1),
        (2045, 1, 1),
    );
    let (b3, sha) = (p.dir.path().join("b3.sig"), p.dir.path().join("sha.sig"));
    let chain = [p.inter_pem.as_path(), p.root_pem.as_path()];
    sign_blake3(&bin, &model, &key, &cert, &chain, &b3);
    sign_cli(&bin, &model, &key, &cert, &chain, &sha);
    let m = manifest(&[]);
    let pol = policy(
        &p.root.pem,
        &["someone@else.example", IDENTITY],
        ValidAt::Issued,
    );

    let sig = std::fs::read(&b3).expect("read");
    let v = verify_with_certificate(&sig, &pol, &m, &blake3_opts()).expect("blake3 verifies");
    assert_eq!(v.mode, "certificate");
    assert_eq!(v.checked.algorithm, "blake3");
    assert_eq!(v.checked.files, 3);
    let c = v.certificate.as_ref().expect("certificate");
    assert_eq!(c.identity, IDENTITY);
    assert_eq!(v.signer(), IDENTITY);
    assert!(c.ca.contains("Models Root CA"), "{c:?}");
    assert!(c.issuer.contains("Models Signing CA"), "{c:?}");

    let sig = std::fs::read(&sha).expect("read");
    // Without the SHA-256 of the files the manifest cannot answer.
    let e = verify_with_certificate(&sig, &pol, &m, &blake3_opts()).expect_err("needs digests");
    assert!(matches!(e, Error::NeedsDigests { .. }), "{e}");
    let v = verify_with_certificate(&sig, &pol, &m, &sha256_digests()).expect("sha256 verifies");
    assert_eq!(v.checked.algorithm, "sha256");
    // The reference accepts the same signature with the same root.
    let (ok, text) = reference_verifies(&bin, &model, &sha, &p.root_pem);
    assert!(
        ok,
        "model_signing refused its own certificate signature: {text}"
    );

    // A changed file is named, as in key mode.
    let e = verify_with_certificate(
        &std::fs::read(&b3).expect("read"),
        &pol,
        &manifest(&[("weights.bin", b"tampered")]),
        &blake3_opts(),
    )
    .expect_err("changed file");
    let Error::Mismatch { problems, .. } = &e else {
        panic!("{e}")
    };
    assert!(
        matches!(&problems[..], [Problem::Changed { path, .. }] if path == "weights.bin"),
        "{e}"
    );

    // A key does not verify a certificate signature, and says what to give instead.
    let pubkey = sealed_provenance::PublicKey::from_pem(
        &String::from_utf8(std::fs::read(&cert).expect("read")).expect("utf-8"),
    );
    assert!(pubkey.is_err(), "a certificate PEM is not a public key");
}

#[test]
fn wrong_ca_wrong_identity_and_expired_certificates_are_refused_naming_what_failed() {
    let Some(bin) = reference() else { return };
    let p = pki();
    let model = p.dir.path().join("m");
    write_model(&model);
    let m = manifest(&[]);
    let d = p.dir.path();

    // A good signature, checked against another root CA and for another identity.
    let (key, cert) = leaf(
        d,
        "release-bot",
        &p.inter,
        IDENTITY,
        (2024, 1, 1),
        (2045, 1, 1),
    );
    let good = d.join("good.sig");
    sign_blake3(
        &bin,
        &model,
        &key,
        &cert,
        &[&p.inter_pem, &p.root_pem],
        &good,
    );
    let good = std::fs::read(&good).expect("read");
    let other_root = ca("Models Root CA", (2020, 1, 1), (2060, 1, 1), None);
    // Same name as the real root, another key: the chain names it but it did not sign.
    let e = verify_with_certificate(
        &good,
        &policy(&other_root.pem, &[IDENTITY], ValidAt::Issued),
        &m,
        &blake3_opts(),
    )
    .expect_err("wrong CA");
    assert!(matches!(e, Error::WrongCa { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.starts_with("wrong CA: the signing certificate CN=release-bot"),
        "{msg}"
    );
    let unrelated = ca("Someone Else CA", (2020, 1, 1), (2060, 1, 1), None);
    let e = verify_with_certificate(
        &good,
        &policy(&unrelated.pem, &[IDENTITY], ValidAt::Issued),
        &m,
        &blake3_opts(),
    )
    .expect_err("wrong CA");
    assert!(
        e.to_string()
            .contains("does not chain to a CA of the bundle (CN=Someone Else CA)"),
        "{e}"
    );

    let e = verify_with_certificate(
        &good,
        &policy(&p.root.pem, &["release-bot@evil.example"], ValidAt::Issued),
        &m,
        &blake3_opts(),
    )
    .expect_err("wrong identity");
    assert_eq!(
        e.to_string(),
        format!(
            "wrong identity: the signing certificate CN=release-bot names {IDENTITY}, none of \
             the accepted identities release-bot@evil.example"
        )
    );

    // An expired signing certificate: model_signing checks the chain when the certificate was
    // issued, so it (and we by default) accept it; checked now, it is refused.
    let (key, cert) = leaf(d, "old-bot", &p.inter, IDENTITY, (2021, 1, 1), (2022, 1, 1));
    let old = d.join("old.sig");
    sign_cli(
        &bin,
        &model,
        &key,
        &cert,
        &[&p.inter_pem, &p.root_pem],
        &old,
    );
    let (ok, text) = reference_verifies(&bin, &model, &old, &p.root_pem);
    assert!(
        ok,
        "model_signing refused an expired signing certificate: {text}"
    );
    let old = std::fs::read(&old).expect("read");
    verify_with_certificate(
        &old,
        &policy(&p.root.pem, &[IDENTITY], ValidAt::Issued),
        &m,
        &sha256_digests(),
    )
    .expect("valid when issued, as model_signing checks");
    let e = verify_with_certificate(
        &old,
        &policy(&p.root.pem, &[IDENTITY], ValidAt::Time(SystemTime::now())),
        &m,
        &sha256_digests(),
    )
    .expect_err("expired now");
    let msg = e.to_string();
    assert!(
        msg.starts_with(
            "expired certificate: the signing certificate CN=old-bot expired at \
             2022-01-01T00:00:00+00:00, before "
        ) && msg.ends_with("(the time of verification)"),
        "{msg}"
    );

    // A certificate issued by an intermediate CA that had expired by then: refused by both.
    let stale = ca(
        "Stale Signing CA",
        (2015, 1, 1),
        (2019, 1, 1),
        Some(&p.root),
    );
    let stale_pem = d.join("stale.pem");
    std::fs::write(&stale_pem, &stale.pem).expect("write");
    let (key, cert) = leaf(d, "late-bot", &stale, IDENTITY, (2020, 6, 1), (2040, 1, 1));
    let late = d.join("late.sig");
    sign_cli(&bin, &model, &key, &cert, &[&stale_pem, &p.root_pem], &late);
    let (ok, text) = reference_verifies(&bin, &model, &late, &p.root_pem);
    assert!(
        !ok,
        "model_signing accepted a certificate from an expired CA: {text}"
    );
    let e = verify_with_certificate(
        &std::fs::read(&late).expect("read"),
        &policy(&p.root.pem, &[IDENTITY], ValidAt::Issued),
        &m,
        &sha256_digests(),
    )
    .expect_err("expired intermediate");
    assert_eq!(
        e.to_string(),
        "expired certificate: the intermediate certificate CN=Stale Signing CA expired at \
         2019-01-01T00:00:00+00:00, before 2020-06-01T00:00:00+00:00 (when the signing \
         certificate was issued (its notBefore, the time model_signing checks))"
    );

    // The root CA itself expired before it issued: webpki alone would not check a trust
    // anchor's validity; we do, as OpenSSL (the reference) does.
    let old_root = ca("Old Root CA", (2010, 1, 1), (2019, 1, 1), None);
    let old_root_pem = d.join("old-root.pem");
    std::fs::write(&old_root_pem, &old_root.pem).expect("write");
    let (key, cert) = leaf(
        d,
        "orphan-bot",
        &old_root,
        IDENTITY,
        (2020, 6, 1),
        (2040, 1, 1),
    );
    let orphan = d.join("orphan.sig");
    sign_cli(&bin, &model, &key, &cert, &[&old_root_pem], &orphan);
    let (ok, text) = reference_verifies(&bin, &model, &orphan, &old_root_pem);
    assert!(
        !ok,
        "model_signing accepted a certificate from an expired root: {text}"
    );
    let e = verify_with_certificate(
        &std::fs::read(&orphan).expect("read"),
        &policy(&old_root.pem, &[IDENTITY], ValidAt::Issued),
        &m,
        &sha256_digests(),
    )
    .expect_err("expired root");
    assert!(
        e.to_string().starts_with(
            "expired certificate: the CA certificate CN=Old Root CA expired at \
             2019-01-01T00:00:00+00:00"
        ),
        "{e}"
    );
}

#[test]
fn the_modes_do_not_cross() {
    let Some(bin) = reference() else { return };
    let p = pki();
    let model = p.dir.path().join("m");
    write_model(&model);
    let (key, cert) = leaf(
        p.dir.path(),
        "bot",
        &p.inter,
        IDENTITY,
        (2024, 1, 1),
        (2045, 1, 1),
    );
    let sig = p.dir.path().join("c.sig");
    sign_blake3(&bin, &model, &key, &cert, &[&p.inter_pem], &sig);
    let sig = std::fs::read(&sig).expect("read");
    // The certificate's own key, in key mode, is told to use the CA instead.
    let leaf_key = KeyPair::from_pem(&std::fs::read_to_string(&key).expect("read")).expect("key");
    let public = sealed_provenance::PublicKey::from_pem(&leaf_key.public_key_pem()).expect("pub");
    let e = verify_with_key(&sig, &public, &manifest(&[]), &blake3_opts()).expect_err("cert mode");
    assert!(e.to_string().contains("--ca PEM --cert-identity ID"), "{e}");
    // A key-mode signature given to the certificate verifier is told to use the key.
    let key_sig = sealed_provenance::sign_manifest(
        &manifest(&[]),
        "m",
        &["model.sig".to_string()],
        &sealed_provenance::SigningKey::from_pem(&leaf_key.serialize_pem()).expect("key"),
    )
    .expect("sign");
    let e = verify_with_certificate(
        &key_sig,
        &policy(&p.root.pem, &[IDENTITY], ValidAt::Issued),
        &manifest(&[]),
        &blake3_opts(),
    )
    .expect_err("key mode");
    assert!(e.to_string().contains("key mode"), "{e}");
    // No identity: refused when the policy is made.
    let e = CertificatePolicy::from_pem(p.root.pem.as_bytes(), vec![], ValidAt::Issued)
        .expect_err("no identity");
    assert!(e.to_string().contains("no identity given"), "{e}");
}
