//! Signatures made by the reference implementation (`model_signing` 1.1.1, tests/vectors/README.md)
//! checked against a manifest of the same tree, and every way of tampering refused, each naming
//! what failed. No file bytes: a manifest holds only each file's BLAKE3.

use sealed_provenance::{
    Bundle, CheckOptions, Error, Problem, PublicKey, SigningKey, sign_manifest, verify_with_key,
};
use sealed_store::chunker::ChunkParams;
use sealed_store::digest::Digest;
use sealed_store::manifest::{ChunkRef, Entry, EntryKind, FileEntry, Manifest};

const VECTORS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/vectors");

fn vector(name: &str) -> Vec<u8> {
    std::fs::read(format!("{VECTORS}/{name}")).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn key(name: &str) -> PublicKey {
    PublicKey::from_pem(&String::from_utf8(vector(name)).expect("utf-8")).expect("public key")
}

fn file(path: &str, content: &[u8]) -> Entry {
    let digest = Digest::of(content);
    Entry {
        path: path.into(),
        kind: EntryKind::File(FileEntry {
            executable: false,
            size: content.len() as u64,
            blake3: digest,
            chunks: vec![ChunkRef {
                digest,
                len: content.len() as u32,
            }],
        }),
    }
}

fn dir(path: &str) -> Entry {
    Entry {
        path: path.into(),
        kind: EntryKind::Dir,
    }
}

/// The manifest of a tree (sorted as the sealer sorts).
fn manifest(mut entries: Vec<Entry>) -> Manifest {
    entries.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
    let m = Manifest {
        chunking: ChunkParams::default(),
        entries,
    };
    m.validate().expect("a valid manifest");
    m
}

/// The tree the vectors sign.
fn signed_tree() -> Vec<Entry> {
    vec![
        file("a-c", b"x"),
        file("a.txt", b"hello\n"),
        dir("sub"),
        file("sub/b.bin", b"world\n"),
    ]
}

fn verify(sig: &str, pub_key: &str, m: &Manifest) -> Result<sealed_provenance::Verified, Error> {
    verify_with_key(&vector(sig), &key(pub_key), m, &CheckOptions::default())
}

#[test]
fn reference_blake3_signatures_verify_from_the_manifest() {
    let m = manifest(signed_tree());
    for (sig, pub_key, curve) in [
        ("p256-blake3.sig", "p256.pub.pem", "P-256"),
        ("p384-blake3.sig", "p384.pub.pem", "P-384"),
    ] {
        let v = verify(sig, pub_key, &m).unwrap_or_else(|e| panic!("{sig}: {e}"));
        assert_eq!(v.checked.files, 3, "{sig}");
        assert_eq!(v.checked.algorithm, "blake3");
        assert_eq!(v.checked.model_name, "m");
        assert_eq!(v.key_curve, curve);
    }
}

#[test]
fn the_signature_file_itself_and_ignored_paths_are_not_unsigned_files() {
    // model_signing writes model.sig at the root and lists .git* as ignored.
    let mut tree = signed_tree();
    tree.push(file("model.sig", b"{}"));
    tree.push(dir(".git"));
    tree.push(file(".git/HEAD", b"ref: main\n"));
    let m = manifest(tree);
    // The statement of p256-blake3.sig (written outside the tree) ignores only .git paths:
    // model.sig is unsigned unless the caller names it as the signature.
    let err = verify("p256-blake3.sig", "p256.pub.pem", &m).unwrap_err();
    assert!(
        matches!(&err, Error::Mismatch { problems, .. }
        if problems == &[Problem::Added { path: "model.sig".into() }]),
        "{err}"
    );
    let opts = CheckOptions {
        ignore_paths: vec!["model.sig".into()],
        ..Default::default()
    };
    let v = verify_with_key(&vector("p256-blake3.sig"), &key("p256.pub.pem"), &m, &opts)
        .expect("verifies");
    assert_eq!(
        v.checked.ignored,
        vec![".git/HEAD".to_string(), "model.sig".to_string()]
    );
}

#[test]
fn a_sha256_statement_says_the_manifest_has_no_sha256() {
    let m = manifest(signed_tree());
    let err = verify("p256-sha256.sig", "p256.pub.pem", &m).unwrap_err();
    assert!(
        matches!(&err, Error::NeedsDigests { algorithm, files: 3 } if algorithm == "sha256"),
        "{err}"
    );
    assert!(
        err.to_string().contains("records only each file's BLAKE3"),
        "{err}"
    );
    // Given each file's SHA-256 (read by the caller, on purpose), it verifies.
    let sha = |b: &[u8]| {
        use sha2::Digest as _;
        sha2::Sha256::digest(b).to_vec()
    };
    let opts = CheckOptions {
        digests: Some(
            [
                ("a-c", sha(b"x")),
                ("a.txt", sha(b"hello\n")),
                ("sub/b.bin", sha(b"world\n")),
            ]
            .into_iter()
            .map(|(p, d)| (p.to_string(), d))
            .collect(),
        ),
        ..Default::default()
    };
    let v = verify_with_key(&vector("p256-sha256.sig"), &key("p256.pub.pem"), &m, &opts)
        .expect("verifies");
    assert_eq!(v.checked.algorithm, "sha256");
}

#[test]
fn a_changed_file_is_named() {
    let mut tree = signed_tree();
    tree[1] = file("a.txt", b"hellO\n");
    let err = verify("p256-blake3.sig", "p256.pub.pem", &manifest(tree)).unwrap_err();
    match &err {
        Error::Mismatch { problems, .. } => {
            assert!(
                matches!(problems.as_slice(), [Problem::Changed { path, .. }] if path == "a.txt"),
                "{err}"
            )
        }
        _ => panic!("{err}"),
    }
    assert!(err.to_string().contains("changed file a.txt"), "{err}");
}

#[test]
fn an_added_file_is_named() {
    let mut tree = signed_tree();
    tree.push(file("sub/extra.bin", b"payload"));
    let err = verify("p256-blake3.sig", "p256.pub.pem", &manifest(tree)).unwrap_err();
    assert!(
        err.to_string().contains("added file sub/extra.bin"),
        "{err}"
    );
}

#[test]
fn a_removed_file_is_named() {
    let mut tree = signed_tree();
    tree.remove(3);
    let err = verify("p256-blake3.sig", "p256.pub.pem", &manifest(tree)).unwrap_err();
    assert!(err.to_string().contains("removed file sub/b.bin"), "{err}");
}

#[test]
fn a_wrong_key_is_named() {
    let m = manifest(signed_tree());
    let err = verify("p256-blake3.sig", "p384.pub.pem", &m).unwrap_err();
    assert!(matches!(err, Error::WrongKey { .. }), "{err}");
    assert!(err.to_string().starts_with("wrong key"), "{err}");
    // Without the hint, the signature itself fails.
    let mut bundle: serde_json::Value =
        serde_json::from_slice(&vector("p256-blake3.sig")).expect("json");
    bundle["verificationMaterial"]["publicKey"]["hint"] = serde_json::Value::Null;
    let no_hint = serde_json::to_vec(&bundle).expect("json");
    let err =
        verify_with_key(&no_hint, &key("p384.pub.pem"), &m, &CheckOptions::default()).unwrap_err();
    assert!(
        matches!(err, Error::BadSignature { curve: "P-384" }),
        "{err}"
    );
}

#[test]
fn an_altered_statement_fails_the_signature() {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut bundle: serde_json::Value =
        serde_json::from_slice(&vector("p256-blake3.sig")).expect("json");
    let payload = b64
        .decode(bundle["dsseEnvelope"]["payload"].as_str().expect("payload"))
        .expect("b64");
    let text = String::from_utf8(payload)
        .expect("utf-8")
        .replace("\"a.txt\"", "\"b.txt\"");
    bundle["dsseEnvelope"]["payload"] = b64.encode(text).into();
    let err = verify_with_key(
        &serde_json::to_vec(&bundle).expect("json"),
        &key("p256.pub.pem"),
        &manifest(signed_tree()),
        &CheckOptions::default(),
    )
    .unwrap_err();
    assert!(matches!(err, Error::BadSignature { .. }), "{err}");
}

#[test]
fn a_signature_for_another_model_is_named() {
    let other = manifest(vec![
        file("config.json", b"{}"),
        file("weights.safetensors", b"\0\0"),
    ]);
    let err = verify("p256-blake3.sig", "p256.pub.pem", &other).unwrap_err();
    assert!(
        matches!(&err, Error::OtherModel { model, signed: 3 } if model == "m"),
        "{err}"
    );
    assert!(
        err.to_string().starts_with("signature for another model"),
        "{err}"
    );
}

#[test]
fn keyless_and_certificate_bundles_are_refused_saying_why() {
    let mut bundle: serde_json::Value =
        serde_json::from_slice(&vector("p256-blake3.sig")).expect("json");
    bundle["verificationMaterial"] =
        serde_json::json!({"certificate": {"rawBytes": "AA=="}, "tlogEntries": [{}]});
    let err = Bundle::parse(&serde_json::to_vec(&bundle).expect("json"))
        .expect("parses")
        .verify_with_key(&key("p256.pub.pem"))
        .unwrap_err();
    assert!(
        err.to_string().contains("cannot be checked offline"),
        "{err}"
    );
    bundle["verificationMaterial"] =
        serde_json::json!({"x509CertificateChain": {"certificates": []}});
    let err = Bundle::parse(&serde_json::to_vec(&bundle).expect("json"))
        .expect("parses")
        .verify_with_key(&key("p256.pub.pem"))
        .unwrap_err();
    assert!(err.to_string().contains("certificate mode"), "{err}");
}

#[test]
fn the_key_hint_is_model_signings() {
    // model_signing's hint for p256.pub.pem, from the bundle it wrote.
    let bundle: serde_json::Value =
        serde_json::from_slice(&vector("p256-blake3.sig")).expect("json");
    let hint = bundle["verificationMaterial"]["publicKey"]["hint"]
        .as_str()
        .expect("hint");
    assert_eq!(key("p256.pub.pem").hint().expect("hint"), hint);
}

#[test]
fn our_signature_verifies_and_signs_what_model_signing_signs() {
    // A throwaway P-256 key (SEC1 PEM as `openssl ecparam -genkey` writes it).
    let secret = p256::SecretKey::from_slice(&[7u8; 32]).expect("scalar");
    let pem = p256::pkcs8::EncodePrivateKey::to_pkcs8_pem(&secret, p256::pkcs8::LineEnding::LF)
        .expect("pem");
    let signer = SigningKey::from_pem(&pem).expect("signing key");
    let m = manifest(signed_tree());
    let sig = sign_manifest(&m, "m", &["model.sig".to_string()], &signer).expect("sign");
    let v = verify_with_key(&sig, &signer.public_key(), &m, &CheckOptions::default())
        .expect("verifies");
    assert_eq!(v.checked.files, 3);
    // The same file list, order and digests as the reference's BLAKE3 statement.
    let ours = Bundle::parse(&sig)
        .expect("bundle")
        .verify_with_key(&signer.public_key())
        .expect("ok");
    let theirs = Bundle::parse(&vector("p256-blake3.sig"))
        .expect("bundle")
        .verify_with_key(&key("p256.pub.pem"))
        .expect("ok");
    assert_eq!(ours.resources, theirs.resources);
    // Deterministic (RFC 6979): the same manifest and key give the same bytes.
    assert_eq!(
        sig,
        sign_manifest(&m, "m", &["model.sig".to_string()], &signer).expect("sign")
    );
}
