//! OpenSSF model signatures with the reference implementation, both ways: `model_signing`
//! (PyPI, pinned in hack/install-test-deps.sh) signs a directory and `sealed verify --signature`
//! accepts it from the manifest alone; `sealed push --sign` signs and model_signing's verifier
//! accepts it. Every tampering is refused naming what failed. "From the manifest alone" is
//! checked by deleting every chunk of the store first: a read of one would fail the command.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use common::Env;
use sealed_provenance::SigningKey;
use sealed_test_support::servers::missing;

/// The pinned reference; hack/install-test-deps.sh installs it in its own venv.
const MODEL_SIGNING_VERSION: &str = "1.1.1";

/// The venv's directory: $SEALED_MODEL_SIGNING_VENV, else where hack/install-test-deps.sh puts it.
fn venv() -> PathBuf {
    if let Some(v) = std::env::var_os("SEALED_MODEL_SIGNING_VENV") {
        return PathBuf::from(v);
    }
    let cache = std::env::var_os("SEALED_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()))
                .join(".cache/sealed-volumes")
        });
    cache.join(format!("model-signing-{MODEL_SIGNING_VERSION}"))
}

/// The venv's `model_signing` and `python`, or None (the test skips; fails under
/// SEALED_REQUIRE_SERVERS=1).
fn reference() -> Option<(PathBuf, PathBuf)> {
    let bin = venv().join("bin");
    let cli = bin.join("model_signing");
    if missing(
        &cli.display().to_string(),
        &format!("hack/install-test-deps.sh installs model-signing=={MODEL_SIGNING_VERSION}"),
    ) {
        return None;
    }
    Some((cli, bin.join("python")))
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

/// A P-256 key pair in PEM files (PKCS#8 private key, SPKI public key), from a fixed seed.
fn key_pair(dir: &Path, name: &str, seed: u8) -> (PathBuf, PathBuf) {
    let secret = p256::SecretKey::from_slice(&[seed; 32]).expect("scalar");
    let pem = p256::pkcs8::EncodePrivateKey::to_pkcs8_pem(&secret, p256::pkcs8::LineEnding::LF)
        .expect("pem");
    let public = SigningKey::from_pem(&pem)
        .expect("key")
        .public_key()
        .to_pem()
        .expect("pem");
    let (private_path, public_path) = (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.pub.pem")),
    );
    std::fs::write(&private_path, pem.as_bytes()).expect("write");
    std::fs::write(&public_path, public).expect("write");
    (private_path, public_path)
}

/// A small model: a few files, one in a subdirectory.
fn model(dir: &Path) {
    std::fs::create_dir_all(dir.join("tokenizer")).expect("mkdir");
    std::fs::write(dir.join("config.json"), b"{\"layers\": 2}\n").expect("write");
    std::fs::write(
        dir.join("model.safetensors"),
        (0..200_000u32)
            .flat_map(|i| i.to_le_bytes())
            .collect::<Vec<u8>>(),
    )
    .expect("write");
    std::fs::write(dir.join("tokenizer/vocab.txt"), b"a\nb\nc\n").expect("write");
}

/// `model_signing`'s Python API signing `dir` with BLAKE3 (its CLI signs SHA-256 only).
fn sign_blake3(python: &Path, key: &Path, dir: &Path, out: &Path) {
    let script = format!(
        "import model_signing\nfrom model_signing import hashing\n\
         model_signing.signing.Config().use_elliptic_key_signer(private_key={key:?})\
         .set_hashing_config(hashing.Config().use_file_serialization(hashing_algorithm='blake3')\
         .set_ignored_paths(paths=['model.sig'])).sign({dir:?}, {out:?})\n",
        key = key.display().to_string(),
        dir = dir.display().to_string(),
        out = out.display().to_string(),
    );
    let (ok, text) = run(Command::new(python).args(["-c", &script]));
    assert!(ok, "model_signing (blake3) failed: {text}");
}

fn push(env: &Env, dir: &Path) -> String {
    let (ok, out, err) = env.run(&["push", dir.to_str().expect("utf-8"), "--no-progress"]);
    assert!(ok, "push failed: {err}");
    out.trim().to_string()
}

/// `sealed verify DIGEST --signature SIG --key KEY`: exit code and output.
fn verify(env: &Env, digest: &str, sig: &Path, key: &Path, extra: &[&str]) -> (i32, String) {
    let out = env
        .sealed()
        .args(["verify", digest, "--signature"])
        .arg(sig)
        .arg("--key")
        .arg(key)
        .args(extra)
        .output()
        .expect("spawn");
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Every chunk of the store gone: from here on a command that reads one fails.
fn delete_chunks(env: &Env) {
    let chunks = env.path("store/chunks");
    assert!(chunks.is_dir(), "no chunks/ in the file store");
    std::fs::remove_dir_all(chunks).expect("rm chunks");
}

#[test]
fn model_signing_signatures_verify_from_the_manifest_alone() {
    let Some((cli, python)) = reference() else {
        return;
    };
    let env = Env::new();
    let (private, public) = key_pair(env.dir.path(), "publisher", 3);
    let dir = env.path("model");
    model(&dir);
    // The reference CLI: SHA-256, model.sig at the root (as a Hub repo carries it).
    let sha_sig = dir.join("model.sig");
    let (ok, text) = run(Command::new(&cli)
        .args(["sign", "key", "--private_key"])
        .arg(&private)
        .arg("--signature")
        .arg(&sha_sig)
        .arg(&dir));
    assert!(ok, "model_signing sign key: {text}");
    let b3_sig = env.path("blake3.sig");
    sign_blake3(&python, &private, &dir, &b3_sig);
    // The pushed version holds model.sig too: it is the signature, not an unsigned file.
    let digest = push(&env, &dir);

    // SHA-256: the manifest has none; said so, and verified only when reading is asked for.
    let (code, out) = verify(&env, &digest, &sha_sig, &public, &[]);
    assert_eq!(code, 6, "{out}");
    assert!(
        out.contains("records only each file's BLAKE3") && out.contains("--read-files"),
        "{out}"
    );
    let (code, out) = verify(&env, &digest, &sha_sig, &public, &["--read-files"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("3 files match their sha256 digests, read from the store"),
        "{out}"
    );

    // BLAKE3: from the manifest, with no chunk left in the store to read.
    delete_chunks(&env);
    let started = Instant::now();
    let (code, out) = verify(&env, &digest, &b3_sig, &public, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("3 files match their blake3 digests, from the manifest alone"),
        "{out}"
    );
    eprintln!(
        "verify --signature (blake3, no chunk in the store): {:?}",
        started.elapsed()
    );
    // And the plain verify, which reads chunks, does fail now: the deletion is real.
    let (ok, _, _) = env.run(&["verify", &digest, "--no-progress"]);
    assert!(!ok, "verify without --signature read no chunk?");
}

#[test]
fn sealed_push_sign_verifies_with_model_signing() {
    let Some((_, python)) = reference() else {
        return;
    };
    let env = Env::new();
    let (private, public) = key_pair(env.dir.path(), "publisher", 5);
    let dir = env.path("model");
    model(&dir);
    let (ok, out, err) = env.run(&[
        "push",
        dir.to_str().expect("utf-8"),
        "--no-progress",
        "--sign",
        private.to_str().expect("utf-8"),
    ]);
    assert!(ok, "push --sign: {err}");
    let digest = out.trim().to_string();
    let sig = dir.join("model.sig");
    assert!(err.contains("signed") && sig.is_file(), "{err}");
    // model_signing's Python API, which reads the hash from the signature (its 1.1.1 command
    // line always hashes SHA-256, so it cannot check a BLAKE3 signature, anyone's).
    let reference_verify = |dir: &Path| {
        let script = format!(
            "import model_signing\n\
             model_signing.verifying.Config().use_elliptic_key_verifier(public_key={key:?})\
             .verify({dir:?}, {sig:?})\n",
            key = public.display().to_string(),
            dir = dir.display().to_string(),
            sig = sig.display().to_string(),
        );
        run(Command::new(&python).args(["-c", &script]))
    };
    let (ok, text) = reference_verify(&dir);
    assert!(
        ok,
        "model_signing verify key refused sealed's signature: {text}"
    );
    // Ours accepts it from the manifest too.
    let (code, out) = verify(&env, &digest, &sig, &public, &[]);
    assert_eq!(code, 0, "{out}");
    // The reference is not accepting anything: a changed file fails it.
    std::fs::write(dir.join("config.json"), b"{\"layers\": 3}\n").expect("write");
    let (ok, text) = reference_verify(&dir);
    assert!(!ok, "model_signing verified a changed file: {text}");
}

#[test]
fn tampered_versions_are_refused_naming_what_failed() {
    let Some((_, python)) = reference() else {
        return;
    };
    let env = Env::new();
    let (private, public) = key_pair(env.dir.path(), "publisher", 7);
    let (_, other_public) = key_pair(env.dir.path(), "someone-else", 9);
    let dir = env.path("model");
    model(&dir);
    let sig = env.path("model.sig");
    sign_blake3(&python, &private, &dir, &sig);
    let good = push(&env, &dir);
    assert_eq!(verify(&env, &good, &sig, &public, &[]).0, 0);

    let variant = |name: &str, change: &dyn Fn(&Path)| -> String {
        let d = env.path(name);
        model(&d);
        change(&d);
        push(&env, &d)
    };
    let changed = variant("changed", &|d| {
        std::fs::write(d.join("tokenizer/vocab.txt"), b"a\nb\nX\n").expect("write")
    });
    let added = variant("added", &|d| {
        std::fs::write(d.join("backdoor.py"), b"import os\n").expect("write")
    });
    let removed = variant("removed", &|d| {
        std::fs::remove_file(d.join("config.json")).expect("rm")
    });
    let other_model = env.path("other");
    std::fs::create_dir_all(&other_model).expect("mkdir");
    std::fs::write(other_model.join("weights.bin"), b"another model").expect("write");
    let other = push(&env, &other_model);
    delete_chunks(&env);

    for (digest, key, expect) in [
        (&changed, &public, "changed file tokenizer/vocab.txt"),
        (&added, &public, "added file backdoor.py"),
        (&removed, &public, "removed file config.json"),
        (&good, &other_public, "wrong key"),
        (&other, &public, "signature for another model"),
    ] {
        let (code, out) = verify(&env, digest, &sig, key, &[]);
        assert_eq!(code, 6, "{expect}: {out}");
        assert!(out.contains(expect), "expected {expect:?} in: {out}");
    }
}

/// A version of 10 GiB (ten 1 GiB files in 4 MiB chunks) whose chunks were never written: a
/// manifest alone in the store. `verify --signature` accepts its signature, so it read no
/// chunk (none exists), in milliseconds. No model_signing needed: ours signs.
#[test]
fn a_ten_gib_version_verifies_without_a_chunk_in_the_store() {
    use sealed_store::manifest::{ChunkRef, Entry, EntryKind, FileEntry, Manifest};
    const FILES: u64 = 10;
    const CHUNK: u32 = 4 << 20;
    const CHUNKS_PER_FILE: u64 = (1 << 30) / CHUNK as u64;
    let env = Env::new();
    let (private, public) = key_pair(env.dir.path(), "publisher", 11);
    let entries: Vec<Entry> = (0..FILES)
        .map(|f| Entry {
            path: format!("model-{f:05}-of-{FILES:05}.safetensors"),
            kind: EntryKind::File(FileEntry {
                executable: false,
                size: CHUNKS_PER_FILE * u64::from(CHUNK),
                blake3: sealed_store::Digest::of(format!("file {f}").as_bytes()),
                chunks: (0..CHUNKS_PER_FILE)
                    .map(|c| ChunkRef {
                        digest: sealed_store::Digest::of(format!("{f}/{c}").as_bytes()),
                        len: CHUNK,
                    })
                    .collect(),
            }),
        })
        .collect();
    let manifest = Manifest {
        chunking: sealed_store::ChunkParams::default(),
        entries,
    };
    assert_eq!(manifest.total_size(), 10 << 30);
    let (bytes, digest) = manifest.seal().expect("seal");
    let key = sealed_store::layout::manifest_key(&digest);
    let path = env.path("store").join(key.as_ref());
    std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    std::fs::write(&path, bytes).expect("write manifest");
    assert!(!env.path("store/chunks").exists());
    let signer =
        SigningKey::from_pem(&std::fs::read_to_string(&private).expect("key")).expect("key");
    let sig = env.path("model.sig");
    let bundle = sealed_provenance::sign_manifest(&manifest, "big", &[], &signer).expect("sign");
    std::fs::write(&sig, bundle).expect("write");

    let started = Instant::now();
    let (code, out) = verify(&env, &digest.to_string(), &sig, &public, &[]);
    let took = started.elapsed();
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("10 files match their blake3 digests, from the manifest alone"),
        "{out}"
    );
    eprintln!("verify --signature of a 10 GiB version, no chunk in the store: {took:?}");
    assert!(took < std::time::Duration::from_secs(10), "{took:?}");
}
