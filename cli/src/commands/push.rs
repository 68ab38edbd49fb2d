use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Args;
use futures::StreamExt;
use sealed_provenance::{DEFAULT_SIGNATURE_NAME, GIT_PATHS, SigningKey, sign_manifest};
use sealed_store::Digest;
use sealed_store::push::{PushOptions, StatCachePolicy, push};
use sealed_store::stat_cache::StatCacheConfig;
use sealed_store::store::validate_volume_name;

use crate::commands::local::{ScanArgs, seal_locally};
use crate::context::Context;
use crate::output::{Bars, bytes, print_json};

#[derive(Args, Debug)]
pub struct PushArgs {
    /// Directory to seal
    pub dir: PathBuf,
    /// Record the version under this volume (NAME or NAMESPACE/NAME)
    #[arg(long)]
    pub volume: Option<String>,
    /// Uploads in flight at once
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    #[command(flatten)]
    pub scan: ScanArgs,
    /// Hash the directory and report its digest and what a push would upload (new chunks
    /// and bytes), writing nothing to the store or the stat cache
    #[arg(long)]
    pub dry_run: bool,
    /// Sign the pushed version with this private key (PEM, ECDSA P-256 or P-384): writes an
    /// OpenSSF model signature (`model_signing` key mode, BLAKE3 from the manifest, no second
    /// read) to DIR/model.sig, or to --signature
    #[arg(long, value_name = "KEY", conflicts_with = "dry_run")]
    pub sign: Option<PathBuf>,
    /// Where --sign writes the signature (default: DIR/model.sig)
    #[arg(long, value_name = "FILE", requires = "sign")]
    pub signature: Option<PathBuf>,
}

pub async fn run(ctx: &Context, args: PushArgs) -> anyhow::Result<ExitCode> {
    if args.dry_run {
        return dry_run(ctx, args).await;
    }
    let filter = args.scan.filter()?;
    // A bad key fails before anything is uploaded.
    let signer = args.sign.as_deref().map(read_signing_key).transpose()?;
    // A push may create a file:// store, as the default one is created.
    let store = ctx.open_store_for_push().await?;
    let opts = PushOptions {
        threads: args.scan.threads,
        concurrency: args.concurrency,
        volume: args.volume,
        follow_symlinks: args.scan.follow(),
        filter,
        stat_cache: stat_cache_policy(args.scan.rehash),
        ..Default::default()
    };
    let bars = Arc::new(Bars::new(ctx.progress));
    let report = push(&store, &args.dir, &opts, bars).await?;
    if let Some(signer) = &signer {
        let manifest = store.get_manifest(&report.digest).await?;
        let path = write_signature(&args.dir, args.signature.as_deref(), &manifest, signer)?;
        eprintln!(
            "signed {} with the {} key {}: {}",
            report.digest,
            signer.public_key().curve(),
            signer.public_key().hint()?,
            path.display()
        );
    }
    if ctx.json() {
        print_json(&report)?;
    } else {
        eprintln!(
            "sealed {} files, {} in {} chunks: uploaded {} ({} chunks), reused {}; read {} \
             ({} files unchanged since the last push)",
            report.files,
            bytes(report.bytes),
            report.chunks,
            bytes(report.bytes_uploaded),
            report.chunks_uploaded,
            bytes(report.bytes_reused),
            bytes(report.bytes_read),
            report.files_cached,
        );
        // The digest alone on stdout, so `d=$(sealed push ./model)` works.
        println!("{}", report.digest);
    }
    Ok(ExitCode::SUCCESS)
}

/// What `push --dry-run` reports: the digest a push would print and what it would upload.
#[derive(serde::Serialize)]
struct DryRun {
    dry_run: bool,
    digest: Digest,
    files: u64,
    /// Bytes of file content in the version.
    bytes: u64,
    unique_chunks: u64,
    /// Distinct chunks the store lacks, and their bytes: what the push would upload.
    chunks_to_upload: u64,
    bytes_to_upload: u64,
    /// The store already has this very version (a push would only record the volume).
    already_in_store: bool,
    volume: Option<String>,
    /// Bytes of local files read and hashed (the rest came from the stat cache).
    bytes_read: u64,
}

/// `--dry-run`: seal in memory, then ask the store (reads only) which chunks it lacks.
async fn dry_run(ctx: &Context, args: PushArgs) -> anyhow::Result<ExitCode> {
    if let Some(v) = &args.volume {
        validate_volume_name(v)?;
    }
    let store = ctx.open_store().await?;
    let bars = Arc::new(Bars::new(ctx.progress));
    let local = seal_locally(&args.dir, store.name(), &args.scan, bars).await?;
    let (_, digest) = local.manifest.seal()?;
    let already_in_store = store.has_manifest(&digest).await?;
    let unique = local.manifest.unique_chunks();
    let (mut chunks_to_upload, mut bytes_to_upload) = (0u64, 0u64);
    // A sealed manifest is written only after every chunk it names: nothing to upload.
    if !already_in_store {
        let mut checks = futures::stream::iter(unique.iter().copied())
            .map(|c| {
                let store = &store;
                async move { store.has_chunk(&c.digest).await.map(|has| (c, has)) }
            })
            .buffer_unordered(args.concurrency.max(1));
        while let Some(checked) = checks.next().await {
            let (c, has) = checked?;
            if !has {
                chunks_to_upload += 1;
                bytes_to_upload = bytes_to_upload
                    .checked_add(u64::from(c.len))
                    .context("more bytes than a u64 counts")?;
            }
        }
    }
    let report = DryRun {
        dry_run: true,
        digest,
        files: local.manifest.files().count() as u64,
        bytes: local.manifest.total_size(),
        unique_chunks: unique.len() as u64,
        chunks_to_upload,
        bytes_to_upload,
        already_in_store,
        volume: args.volume,
        bytes_read: local.bytes_read,
    };
    if ctx.json() {
        print_json(&report)?;
    } else {
        eprintln!(
            "dry run, nothing written: {} files, {} in {} distinct chunks; a push would upload \
             {} ({} chunks){}",
            report.files,
            bytes(report.bytes),
            report.unique_chunks,
            bytes(report.bytes_to_upload),
            report.chunks_to_upload,
            if report.already_in_store {
                "; the store already has this version"
            } else {
                ""
            },
        );
        println!("{}", report.digest);
    }
    Ok(ExitCode::SUCCESS)
}

fn read_signing_key(path: &std::path::Path) -> anyhow::Result<SigningKey> {
    let len = std::fs::metadata(path)
        .with_context(|| format!("cannot read signing key {}", path.display()))?
        .len();
    anyhow::ensure!(
        len <= 64 * 1024,
        "signing key {} has {len} bytes: not a PEM key",
        path.display()
    );
    let pem = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read signing key {}", path.display()))?;
    SigningKey::from_pem(&pem).with_context(|| format!("signing key {}", path.display()))
}

/// Writes the `model_signing` signature of the pushed version: the model's name is the
/// directory's, as `model_signing sign` names it; the signature file and git's files are left
/// out as `model_signing` leaves them out (its ignore paths, recorded in the statement).
fn write_signature(
    dir: &std::path::Path,
    signature: Option<&std::path::Path>,
    manifest: &sealed_store::Manifest,
    signer: &SigningKey,
) -> anyhow::Result<PathBuf> {
    let path = signature.map_or_else(|| dir.join(DEFAULT_SIGNATURE_NAME), PathBuf::from);
    let root = std::fs::canonicalize(dir).with_context(|| format!("{}", dir.display()))?;
    let model_name = root
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    // The signature's name inside the tree, when it is written there.
    let inside = path
        .parent()
        .map(|p| {
            if p.as_os_str().is_empty() {
                std::path::Path::new(".")
            } else {
                p
            }
        })
        .and_then(|p| std::fs::canonicalize(p).ok())
        .and_then(|parent| {
            let rel = parent.strip_prefix(&root).ok()?.join(path.file_name()?);
            rel.to_str().map(str::to_owned)
        });
    let mut ignore: Vec<String> = vec![inside.unwrap_or_else(|| DEFAULT_SIGNATURE_NAME.into())];
    ignore.extend(GIT_PATHS.iter().map(|p| p.to_string()));
    let bundle = sign_manifest(manifest, &model_name, &ignore, signer)
        .context("cannot sign the pushed version")?;
    std::fs::write(&path, bundle)
        .with_context(|| format!("cannot write the signature {}", path.display()))?;
    Ok(path)
}

/// The stat cache under the user's cache directory; without one (no `$HOME`), every file is
/// read, as with `--rehash`.
fn stat_cache_policy(rehash: bool) -> StatCachePolicy {
    match StatCacheConfig::user_default() {
        None => {
            tracing::warn!("no cache directory ($XDG_CACHE_HOME, $HOME): every file is read");
            StatCachePolicy::Off
        }
        Some(cfg) if rehash => StatCachePolicy::Rehash(cfg),
        Some(cfg) => StatCachePolicy::Use(cfg),
    }
}
