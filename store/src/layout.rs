//! The store's object layout: every key the store writes, and how a listed key is read back.
//!
//! ```text
//! <prefix>/chunks/<first 2 hex>/<64 hex>     chunk bytes, named by their BLAKE3
//! <prefix>/manifests/<64 hex>                sealed manifests, written once
//! <prefix>/profiles/<64 hex>                 a manifest's learned prefetch profile, written once
//! <prefix>/volumes/[<ns>/]<name>/<64 hex>    a volume's reference to a version (or its tombstone)
//! <prefix>/trash/<64 hex>                    a deleted manifest's bytes
//! <prefix>/trash/<64 hex>.json               its trash record
//! <prefix>/leases/<32 hex>                   one per writer in flight
//! <prefix>/gc/running                        the collector's marker
//! <prefix>/gc/clock-<32 hex>                 a probe the collector writes to read the store's clock
//! ```
//!
//! Keys are built here and nowhere else. Parsers are strict: a key of another shape (wrong
//! segment count, bad hex, a name that is not a volume name) is not one of ours and gives
//! `None`, so listings skip it rather than act on it.

use object_store::path::{Path as ObjectPath, PathPart};

use crate::digest::Digest;
use crate::error::{Error, Result};

const CHUNKS: &str = "chunks";
const MANIFESTS: &str = "manifests";
const PROFILES: &str = "profiles";
const VOLUMES: &str = "volumes";
const TRASH: &str = "trash";
const LEASES: &str = "leases";
const GC: &str = "gc";
const GC_RUNNING: &str = "running";
const GC_CLOCK: &str = "clock-";
const RECORD_SUFFIX: &str = ".json";
/// Hex characters of a lease or probe id.
const ID_HEX_LEN: usize = 32;

/// Which part of the layout a listing covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prefix {
    Chunks,
    Manifests,
    Volumes,
    Trash,
    Leases,
    Profiles,
}

impl Prefix {
    pub fn path(self) -> ObjectPath {
        ObjectPath::from(match self {
            Prefix::Chunks => CHUNKS,
            Prefix::Manifests => MANIFESTS,
            Prefix::Volumes => VOLUMES,
            Prefix::Trash => TRASH,
            Prefix::Leases => LEASES,
            Prefix::Profiles => PROFILES,
        })
    }
}

/// `chunks/<first 2 hex>/<64 hex>`.
pub fn chunk_key(digest: &Digest) -> ObjectPath {
    let hex = digest.hex();
    ObjectPath::from_iter([CHUNKS, &hex[..2], &hex])
}

pub fn parse_chunk_key(key: &ObjectPath) -> Option<Digest> {
    let [top, shard, hex] = segments(key)?;
    let digest = (top == CHUNKS).then(|| parse_hex_digest(&hex))??;
    (hex.get(..2) == Some(shard.as_str())).then_some(digest)
}

/// `manifests/<64 hex>`.
pub fn manifest_key(digest: &Digest) -> ObjectPath {
    ObjectPath::from_iter([MANIFESTS, &digest.hex()])
}

pub fn parse_manifest_key(key: &ObjectPath) -> Option<Digest> {
    let [top, hex] = segments(key)?;
    (top == MANIFESTS).then(|| parse_hex_digest(&hex))?
}

/// `profiles/<64 hex>.<64 hex>`: the learned prefetch profile of the manifest `digest` names,
/// learned from the readers of the scope `scope` identifies (`crate::prefetch_profile::ProfileScope`).
/// One object name, not a folder per manifest: a file store cannot hold the unscoped key of
/// earlier releases and a folder of the same name.
pub fn profile_key(digest: &Digest, scope: &Digest) -> ObjectPath {
    ObjectPath::from_iter([PROFILES, &format!("{}.{}", digest.hex(), scope.hex())])
}

/// The manifest a profile key is for: a scoped key, or an unscoped `profiles/<64 hex>` of an
/// earlier release (never read now; gc removes it with its version).
pub fn parse_profile_key(key: &ObjectPath) -> Option<Digest> {
    let [top, name] = segments(key)?;
    if top != PROFILES {
        return None;
    }
    let manifest = match name.split_once('.') {
        Some((manifest, scope)) => parse_hex_digest(scope).and(Some(manifest))?,
        None => name.as_str(),
    };
    parse_hex_digest(manifest)
}

/// `volumes/<volume>` where `volume` is `name` or `ns/name`: the records of one volume.
pub fn volume_prefix(volume: &str) -> ObjectPath {
    std::iter::once(VOLUMES).chain(volume.split('/')).collect()
}

/// `volumes/<volume>/<64 hex>`: the record that `digest` was pushed to `volume` (its
/// reference to the version, `crate::refs`).
pub fn volume_record_key(volume: &str, digest: &Digest) -> ObjectPath {
    volume_prefix(volume).child(digest.hex())
}

/// Volume names are `name` or `namespace/name`, each part a DNS-1123 name: lowercase
/// letters, digits, '-' and '.', starting and ending with a letter or digit (so no part is
/// `.` or `..`).
pub fn validate_volume_name(volume: &str) -> Result<()> {
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let ok_part = |p: &str| {
        !p.is_empty()
            && p.len() <= 63
            && p.bytes().all(|b| alnum(b) || b == b'-' || b == b'.')
            && p.bytes().next().is_some_and(alnum)
            && p.bytes().last().is_some_and(alnum)
    };
    let parts: Vec<&str> = volume.split('/').collect();
    if parts.len() > 2 || !parts.iter().all(|p| ok_part(p)) {
        return Err(Error::Other(format!(
            "invalid volume name '{volume}': use NAME or NAMESPACE/NAME with lowercase letters, digits, '-' and '.'"
        )));
    }
    Ok(())
}

/// The volume (`name` or `ns/name`, a valid volume name) and digest a record key names.
pub fn parse_volume_record_key(key: &ObjectPath) -> Option<(String, Digest)> {
    let parts: Vec<String> = key.parts().map(|p| p.as_ref().to_owned()).collect();
    let (top, rest) = parts.split_first()?;
    let (hex, volume) = rest.split_last()?;
    if top != VOLUMES || !(1..=2).contains(&volume.len()) {
        return None;
    }
    let volume = volume.join("/");
    validate_volume_name(&volume).ok()?;
    Some((volume, parse_hex_digest(hex)?))
}

/// `trash/<64 hex>`: the bytes of a deleted manifest.
pub fn trash_manifest_key(digest: &Digest) -> ObjectPath {
    ObjectPath::from_iter([TRASH, &digest.hex()])
}

/// `trash/<64 hex>.json`: the record of a deleted manifest.
pub fn trash_record_key(digest: &Digest) -> ObjectPath {
    ObjectPath::from_iter([TRASH, &(digest.hex() + RECORD_SUFFIX)])
}

/// What a key under `trash/` is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrashKey {
    Manifest(Digest),
    Record(Digest),
}

pub fn parse_trash_key(key: &ObjectPath) -> Option<TrashKey> {
    let [top, name] = segments(key)?;
    if top != TRASH {
        return None;
    }
    match name.strip_suffix(RECORD_SUFFIX) {
        Some(hex) => parse_hex_digest(hex).map(TrashKey::Record),
        None => parse_hex_digest(&name).map(TrashKey::Manifest),
    }
}

/// `leases/<id>`: the lease of one writer. `id` is one segment whatever it holds.
pub fn lease_key(id: &str) -> ObjectPath {
    ObjectPath::from(LEASES).child(id)
}

/// The id of a lease key (32 lowercase hex).
pub fn parse_lease_key(key: &ObjectPath) -> Option<String> {
    let [top, id] = segments(key)?;
    (top == LEASES && is_id(&id)).then_some(id)
}

/// `gc/running`: the collector's marker.
pub fn gc_marker_key() -> ObjectPath {
    ObjectPath::from_iter([GC, GC_RUNNING])
}

/// `gc/clock-<id>`: a probe object the collector writes to read the store's clock.
pub fn gc_clock_key(id: &str) -> ObjectPath {
    ObjectPath::from(GC).child(GC_CLOCK.to_owned() + id)
}

/// The id of a clock probe key (32 lowercase hex).
pub fn parse_gc_clock_key(key: &ObjectPath) -> Option<String> {
    let [top, name] = segments(key)?;
    let id = name.strip_prefix(GC_CLOCK)?;
    (top == GC && is_id(id)).then(|| id.to_owned())
}

/// The key's segments when there are exactly `N`.
fn segments<const N: usize>(key: &ObjectPath) -> Option<[String; N]> {
    let parts: Vec<String> = key
        .parts()
        .map(|p: PathPart<'_>| p.as_ref().to_owned())
        .collect();
    parts.try_into().ok()
}

/// 64 lowercase hex characters, nothing else (no `blake3:` prefix: keys hold the bare hex).
fn parse_hex_digest(text: &str) -> Option<Digest> {
    let hex_ok = text.len() == 2 * Digest::LEN && is_lower_hex(text);
    hex_ok.then(|| Digest::parse(text).ok())?
}

fn is_id(text: &str) -> bool {
    text.len() == ID_HEX_LEN && is_lower_hex(text)
}

fn is_lower_hex(text: &str) -> bool {
    text.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest() -> Digest {
        Digest::of(b"layout")
    }

    fn key(text: &str) -> ObjectPath {
        ObjectPath::from(text)
    }

    #[test]
    fn every_builder_round_trips_through_its_parser() {
        let d = digest();
        assert_eq!(parse_chunk_key(&chunk_key(&d)), Some(d));
        assert_eq!(parse_manifest_key(&manifest_key(&d)), Some(d));
        let scope = Digest::of(b"scope");
        assert_eq!(parse_profile_key(&profile_key(&d, &scope)), Some(d));
        assert_eq!(parse_profile_key(&manifest_key(&d)), None);
        assert_eq!(
            profile_key(&d, &scope).as_ref(),
            format!("profiles/{}.{}", d.hex(), scope.hex())
        );
        // Unscoped, as earlier releases wrote them: still found by gc.
        assert_eq!(
            parse_profile_key(&key(&format!("profiles/{}", d.hex()))),
            Some(d)
        );
        for bad in [
            format!("profiles/{}.", d.hex()),
            format!("profiles/{}.xyz", d.hex()),
            format!("profiles/.{}", d.hex()),
        ] {
            assert_eq!(parse_profile_key(&key(&bad)), None, "{bad}");
        }
        for volume in ["name", "ns/name", "a.b/c-d"] {
            let parsed = parse_volume_record_key(&volume_record_key(volume, &d));
            assert_eq!(parsed, Some((volume.to_owned(), d)));
        }
        assert_eq!(
            parse_trash_key(&trash_manifest_key(&d)),
            Some(TrashKey::Manifest(d))
        );
        assert_eq!(
            parse_trash_key(&trash_record_key(&d)),
            Some(TrashKey::Record(d))
        );
        let id = crate::identity::random_id();
        assert_eq!(parse_lease_key(&lease_key(&id)), Some(id.clone()));
        assert_eq!(parse_gc_clock_key(&gc_clock_key(&id)), Some(id));
    }

    #[test]
    fn keys_have_the_documented_shape() {
        let d = digest();
        let hex = d.hex();
        assert_eq!(
            chunk_key(&d).as_ref(),
            format!("chunks/{}/{hex}", &hex[..2])
        );
        assert_eq!(manifest_key(&d).as_ref(), format!("manifests/{hex}"));
        assert_eq!(
            volume_record_key("ns/name", &d).as_ref(),
            format!("volumes/ns/name/{hex}")
        );
        assert_eq!(volume_prefix("ns/name").as_ref(), "volumes/ns/name");
        assert_eq!(trash_manifest_key(&d).as_ref(), format!("trash/{hex}"));
        assert_eq!(trash_record_key(&d).as_ref(), format!("trash/{hex}.json"));
        assert_eq!(lease_key("abc").as_ref(), "leases/abc");
        assert_eq!(gc_marker_key().as_ref(), "gc/running");
        assert_eq!(gc_clock_key("abc").as_ref(), "gc/clock-abc");
        assert_eq!(Prefix::Chunks.path().as_ref(), "chunks");
        assert_eq!(Prefix::Manifests.path().as_ref(), "manifests");
        assert_eq!(Prefix::Volumes.path().as_ref(), "volumes");
        assert_eq!(Prefix::Trash.path().as_ref(), "trash");
        assert_eq!(Prefix::Leases.path().as_ref(), "leases");
    }

    #[test]
    fn a_lease_id_stays_one_segment() {
        assert_eq!(lease_key("a/b").parts().count(), 2);
        assert_eq!(lease_key("..").parts().count(), 2);
        assert_eq!(parse_lease_key(&lease_key("..")), None);
    }

    #[test]
    fn parsers_reject_bad_hex() {
        let hex = digest().hex();
        let upper = hex.to_uppercase();
        let short = &hex[..63];
        let not_hex = format!("{}g", &hex[..63]);
        for bad in [upper.as_str(), short, not_hex.as_str()] {
            assert_eq!(parse_manifest_key(&key(&format!("manifests/{bad}"))), None);
            assert_eq!(parse_trash_key(&key(&format!("trash/{bad}"))), None);
            assert_eq!(parse_trash_key(&key(&format!("trash/{bad}.json"))), None);
            assert_eq!(
                parse_volume_record_key(&key(&format!("volumes/a/{bad}"))),
                None
            );
        }
        let prefixed = format!("manifests/blake3:{hex}");
        assert_eq!(parse_manifest_key(&key(&prefixed)), None);
        let wrong_shard = format!("chunks/zz/{hex}");
        assert_eq!(parse_chunk_key(&key(&wrong_shard)), None);
        let other_shard = format!(
            "chunks/{}/{hex}",
            if &hex[..2] == "00" { "01" } else { "00" }
        );
        assert_eq!(parse_chunk_key(&key(&other_shard)), None);
        assert_eq!(
            parse_lease_key(&key(&format!("leases/{}", &hex[..31]))),
            None
        );
        assert_eq!(
            parse_lease_key(&key(&format!("leases/{}", &upper[..32]))),
            None
        );
        assert_eq!(parse_gc_clock_key(&key("gc/clock-xyz")), None);
    }

    #[test]
    fn parsers_reject_extra_or_missing_segments() {
        let hex = digest().hex();
        let shard = &hex[..2];
        for bad in [
            format!("chunks/{hex}"),
            format!("chunks/{shard}/{hex}/x"),
            format!("x/chunks/{shard}/{hex}"),
        ] {
            assert_eq!(parse_chunk_key(&key(&bad)), None, "{bad}");
        }
        for bad in [format!("manifests/x/{hex}"), format!("manifests/{hex}/x")] {
            assert_eq!(parse_manifest_key(&key(&bad)), None, "{bad}");
        }
        for bad in [
            format!("volumes/{hex}"),
            format!("volumes/a/b/c/{hex}"),
            format!("volumes/a/{hex}/x"),
        ] {
            assert_eq!(parse_volume_record_key(&key(&bad)), None, "{bad}");
        }
        assert_eq!(parse_trash_key(&key(&format!("trash/x/{hex}"))), None);
        let id = &hex[..32];
        assert_eq!(parse_lease_key(&key(&format!("leases/x/{id}"))), None);
        assert_eq!(parse_gc_clock_key(&key(&format!("gc/x/clock-{id}"))), None);
    }

    #[test]
    fn parsers_reject_other_prefixes() {
        let d = digest();
        assert_eq!(parse_manifest_key(&trash_manifest_key(&d)), None);
        assert_eq!(parse_trash_key(&manifest_key(&d)), None);
        assert_eq!(parse_chunk_key(&manifest_key(&d)), None);
        assert_eq!(parse_volume_record_key(&manifest_key(&d)), None);
        assert_eq!(parse_lease_key(&gc_marker_key()), None);
        assert_eq!(parse_gc_clock_key(&gc_marker_key()), None);
    }

    #[test]
    fn record_keys_need_valid_volume_names() {
        let hex = digest().hex();
        for bad in ["..", ".", "Upper", "-a", "a-", "a_b", ".hidden"] {
            let k = key(&format!("volumes/{bad}/{hex}"));
            assert_eq!(parse_volume_record_key(&k), None, "{bad}");
            let k = key(&format!("volumes/ns/{bad}/{hex}"));
            assert_eq!(parse_volume_record_key(&k), None, "ns/{bad}");
        }
        // `..` as a volume name cannot climb out of `volumes/` either.
        let k = volume_record_key("../x", &digest());
        assert_eq!(
            k.parts().next().map(|p| p.as_ref().to_owned()),
            Some("volumes".into())
        );
        assert_eq!(parse_volume_record_key(&k), None);
    }
}
