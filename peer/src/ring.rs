//! Who owns a chunk: rendezvous (highest-random-weight) hashing over the live members.
//!
//! Every member scores every chunk; the highest scores own it. A member that joins or leaves
//! moves only the chunks it wins or won (about 1/N of them), and every node that sees the same
//! members picks the same owners without talking to the others.
//!
//! A chunk has `owners_for(n)` owners: one while the fleet is small, more as it grows, so
//! that a chunk every node wants at once (a whole model starting on 1,000 nodes) is served by
//! several nodes, each to at most about `fanout` others (see `docs/peer.md`).

use std::sync::Arc;

use sealed_store::Digest;

/// A member of the fleet: the address its peer server listens on (`host:port`), which is
/// also its name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Member {
    pub addr: String,
    /// A hash of the address, mixed into each score.
    key: u64,
}

impl Member {
    pub fn new(addr: impl Into<String>) -> Member {
        let addr = addr.into();
        let hash = blake3::hash(addr.as_bytes());
        let mut key = [0u8; 8];
        key.copy_from_slice(&hash.as_bytes()[..8]);
        Member {
            addr,
            key: u64::from_le_bytes(key),
        }
    }

    /// This member's score for a chunk. The digest is already uniform (BLAKE3), so a
    /// 64-bit mix of it with the member's key is enough.
    fn score(&self, chunk: &Digest) -> u64 {
        let mut word = [0u8; 8];
        word.copy_from_slice(&chunk.as_bytes()[..8]);
        splitmix64(u64::from_le_bytes(word) ^ self.key)
    }
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// One view of the membership. Immutable: a change builds a new ring.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ring {
    members: Vec<Member>,
    /// Most nodes one owner should serve a chunk to at once; the owner set widens to
    /// `ceil(members / fanout)` (at least 1).
    fanout: usize,
}

/// Where this node stands for one chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// No other member: fetch from the origin.
    Alone,
    /// This node is the chunk's primary owner: it fetches from the origin (once).
    Primary,
    /// This node is a secondary owner: it asks the primary (one hop, no further).
    Secondary { primary: Member },
    /// Not an owner: ask `owner`, one of the chunk's owners (picked by this node's name, so
    /// the nodes spread over the owners).
    Requester { owner: Member },
}

impl Ring {
    /// A ring of these addresses (deduplicated, order does not matter).
    pub fn new<I, S>(addrs: I, fanout: usize) -> Ring
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut members: Vec<Member> = addrs.into_iter().map(Member::new).collect();
        members.sort();
        members.dedup_by(|a, b| a.addr == b.addr);
        Ring {
            members,
            fanout: fanout.max(1),
        }
    }

    pub fn members(&self) -> &[Member] {
        &self.members
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    pub fn contains(&self, addr: &str) -> bool {
        self.members.iter().any(|m| m.addr == addr)
    }

    /// How many owners a chunk has in a ring of `n` members.
    pub fn owners_for(&self, n: usize) -> usize {
        n.div_ceil(self.fanout.max(1)).clamp(1, n.max(1))
    }

    /// The chunk's owners, best score first.
    pub fn owners(&self, chunk: &Digest) -> Vec<&Member> {
        self.owners_among(chunk, |_| true)
    }

    /// The chunk's owners among the members `usable` admits, best score first: the ring as
    /// it would be without the others. Rendezvous hashing makes this the next-best member
    /// for each chunk an unusable owner had, the same on every node that skips the same
    /// members, and no change for any other chunk.
    fn owners_among(&self, chunk: &Digest, usable: impl Fn(&Member) -> bool) -> Vec<&Member> {
        let mut scored: Vec<(u64, &Member)> = self
            .members
            .iter()
            .filter(|m| usable(m))
            .map(|m| (m.score(chunk), m))
            .collect();
        let k = self.owners_for(scored.len());
        // Ties (vanishingly rare) break by address, so every node agrees.
        scored.sort_unstable_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.addr.cmp(&b.1.addr)));
        scored.into_iter().take(k).map(|(_, m)| m).collect()
    }

    /// The `n` members that score highest for `key` (all of them when `n` ≥ members), best
    /// first: the chunk owners' rendezvous hashing with a version digest as the key, so every
    /// node that sees the same members picks the same ones, and a member leaving changes the
    /// pick only if it was picked.
    pub fn top(&self, key: &Digest, n: usize) -> Vec<&Member> {
        let mut scored: Vec<(u64, &Member)> =
            self.members.iter().map(|m| (m.score(key), m)).collect();
        scored.sort_unstable_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.addr.cmp(&b.1.addr)));
        scored.into_iter().take(n).map(|(_, m)| m).collect()
    }

    /// Whether `addr` is among the [`Ring::top`] `n` for `key`.
    pub fn picks(&self, key: &Digest, n: usize, addr: &str) -> bool {
        self.top(key, n).iter().any(|m| m.addr == addr)
    }

    /// What the node `me` does for `chunk`. `me` need not be a member (a node that has not
    /// shown up in the membership yet asks like any requester).
    pub fn role(&self, me: &Member, chunk: &Digest) -> Role {
        self.role_skipping(me, chunk, |_| false)
    }

    /// [`Ring::role`] in the ring without the members `skip` names (never `me`): owners that
    /// are down hand their chunks to the next-best members instead of the origin, so a dead
    /// or not-yet-serving node costs the fleet one origin fetch of each of its chunks (by
    /// the member next in line), not one per node that wanted it.
    pub fn role_skipping(
        &self,
        me: &Member,
        chunk: &Digest,
        skip: impl Fn(&Member) -> bool,
    ) -> Role {
        let usable = |m: &Member| m.addr == me.addr || !skip(m);
        let owners = self.owners_among(chunk, usable);
        let Some(primary) = owners.first() else {
            return Role::Alone;
        };
        if primary.addr == me.addr {
            let others = self.members.iter().any(|m| m.addr != me.addr && usable(m));
            return if others { Role::Primary } else { Role::Alone };
        }
        if owners.iter().any(|o| o.addr == me.addr) {
            return Role::Secondary {
                primary: (*primary).clone(),
            };
        }
        // Spread requesters over the owners by their own score for the chunk.
        let pick = (me.score(chunk) % owners.len() as u64) as usize;
        Role::Requester {
            owner: owners[pick].clone(),
        }
    }
}

/// A shared, swappable view (membership sources publish a new `Arc<Ring>`).
pub type RingView = tokio::sync::watch::Receiver<Arc<Ring>>;

#[cfg(test)]
mod tests {
    use super::*;

    fn digests(n: u32) -> Vec<Digest> {
        (0..n).map(|i| Digest::of(&i.to_le_bytes())).collect()
    }

    fn addrs(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("10.0.0.{i}:7070")).collect()
    }

    #[test]
    fn skipping_a_member_moves_only_its_chunks_to_the_next_best() {
        let ring = Ring::new(addrs(6), 64);
        let me = Member::new("10.0.0.0:7070");
        let down = "10.0.0.3:7070";
        let mut moved = 0;
        for c in &digests(3000) {
            let full: Vec<&str> = ring.top(c, 6).iter().map(|m| m.addr.as_str()).collect();
            let role = ring.role_skipping(&me, c, |m| m.addr == down);
            if full[0] != down {
                assert_eq!(
                    role,
                    ring.role(&me, c),
                    "a chunk the down member did not own moved"
                );
                continue;
            }
            moved += 1;
            // The next-best member owns it now: this node, or the one it asks.
            match (full[1], role) {
                (next, Role::Primary) => assert_eq!(next, me.addr),
                (next, Role::Requester { owner }) => assert_eq!(owner.addr, next),
                (_, other) => panic!("unexpected role {other:?}"),
            }
        }
        assert!(
            (300..700).contains(&moved),
            "{moved} of 3000 chunks were the down member's"
        );
    }

    #[test]
    fn a_node_whose_peers_are_all_down_is_alone() {
        let ring = Ring::new(addrs(3), 64);
        let me = Member::new("10.0.0.0:7070");
        for c in &digests(50) {
            assert_eq!(ring.role_skipping(&me, c, |_| true), Role::Alone);
        }
        // Never skipped itself, even when asked to skip everyone: still a member, still Alone.
        let outsider = Member::new("10.9.9.9:7070");
        for c in &digests(50) {
            assert_eq!(ring.role_skipping(&outsider, c, |_| true), Role::Alone);
        }
    }

    #[test]
    fn chunks_spread_evenly_over_owners() {
        let ring = Ring::new(addrs(8), 64);
        let mut counts = std::collections::HashMap::new();
        let chunks = digests(8000);
        for c in &chunks {
            *counts.entry(ring.owners(c)[0].addr.clone()).or_insert(0u32) += 1;
        }
        assert_eq!(counts.len(), 8);
        for (addr, n) in counts {
            assert!((800..1200).contains(&n), "{addr} owns {n} of 8000");
        }
    }

    #[test]
    fn a_member_leaving_moves_only_its_own_chunks() {
        let chunks = digests(10_000);
        let before = Ring::new(addrs(10), 64);
        let gone = "10.0.0.3:7070";
        let after = Ring::new(addrs(10).into_iter().filter(|a| a != gone), 64);
        let mut moved = 0;
        for c in &chunks {
            let (b, a) = (&before.owners(c)[0].addr, &after.owners(c)[0].addr);
            if b != a {
                assert_eq!(b, gone, "a chunk moved away from a member that stayed");
                moved += 1;
            }
        }
        // About 1/10 of the chunks were the leaver's.
        assert!((800..1200).contains(&moved), "{moved} of 10000 moved");
    }

    #[test]
    fn a_member_joining_takes_about_one_nth() {
        let chunks = digests(10_000);
        let before = Ring::new(addrs(10), 64);
        let after = Ring::new(addrs(11), 64);
        let joined = "10.0.0.10:7070";
        let mut moved = 0;
        for c in &chunks {
            let (b, a) = (&before.owners(c)[0].addr, &after.owners(c)[0].addr);
            if b != a {
                assert_eq!(a, joined, "a chunk moved between members that stayed");
                moved += 1;
            }
        }
        assert!(
            (700..1100).contains(&moved),
            "{moved} of 10000 moved (1/11 ≈ 909)"
        );
    }

    #[test]
    fn order_and_duplicates_do_not_change_owners() {
        let mut shuffled = addrs(6);
        shuffled.reverse();
        shuffled.push(shuffled[0].clone());
        let (a, b) = (Ring::new(addrs(6), 64), Ring::new(shuffled, 64));
        assert_eq!(a, b);
        for c in digests(100) {
            assert_eq!(a.owners(&c), b.owners(&c));
        }
    }

    #[test]
    fn owners_widen_with_the_fleet_and_roles_follow() {
        let ring = Ring::new(addrs(10), 4);
        assert_eq!(ring.owners_for(10), 3);
        assert_eq!(ring.owners_for(1), 1);
        assert_eq!(Ring::new(addrs(1000), 64).owners_for(1000), 16);
        let chunk = Digest::of(b"hot");
        let owners: Vec<Member> = ring.owners(&chunk).into_iter().cloned().collect();
        assert_eq!(owners.len(), 3);
        assert_eq!(ring.role(&owners[0], &chunk), Role::Primary);
        assert_eq!(
            ring.role(&owners[2], &chunk),
            Role::Secondary {
                primary: owners[0].clone()
            }
        );
        // Requesters ask owners only, and all of them between them.
        let mut asked = std::collections::HashSet::new();
        for m in ring.members() {
            if let Role::Requester { owner } = ring.role(m, &chunk) {
                assert!(owners.contains(&owner));
                asked.insert(owner.addr);
            }
        }
        assert!(
            asked.len() >= 2,
            "requesters all asked one owner: {asked:?}"
        );
        let alone = Ring::new(["10.0.0.1:1"], 4);
        assert_eq!(alone.role(&Member::new("10.0.0.1:1"), &chunk), Role::Alone);
        assert_eq!(Ring::default().role(&owners[0], &chunk), Role::Alone);
    }
    #[test]
    fn top_n_is_stable_and_covers_small_fleets() {
        let ring = Ring::new(addrs(10), 64);
        let mut counts = std::collections::HashMap::new();
        for key in digests(2000) {
            let top = ring.top(&key, 3);
            assert_eq!(top.len(), 3);
            // The best is the chunk's primary owner: the same hashing.
            assert_eq!(top[0], ring.owners(&key)[0]);
            for m in &top {
                *counts.entry(m.addr.clone()).or_insert(0u32) += 1;
                assert!(ring.picks(&key, 3, &m.addr));
            }
            // A member that was not picked leaving changes nothing.
            let out = ring
                .members()
                .iter()
                .find(|m| !top.contains(m))
                .map(|m| m.addr.clone())
                .unwrap();
            let smaller = Ring::new(addrs(10).into_iter().filter(|a| *a != out), 64);
            assert_eq!(smaller.top(&key, 3), top, "the pick moved when {out} left");
        }
        // Versions spread over the fleet (2000 × 3 / 10 = 600 each).
        assert_eq!(counts.len(), 10);
        for (addr, n) in counts {
            assert!((450..750).contains(&n), "{addr} picked {n} times");
        }
        let key = Digest::of(b"version");
        assert_eq!(ring.top(&key, 10).len(), 10);
        assert_eq!(ring.top(&key, 1000).len(), 10);
        assert!(ring.top(&key, 0).is_empty());
        let alone = Ring::new(["10.0.0.1:1"], 64);
        assert!(alone.picks(&key, 1, "10.0.0.1:1"));
        assert!(!alone.picks(&key, 0, "10.0.0.1:1"));
        assert!(!alone.picks(&key, 5, "10.0.0.2:1"));
    }
}
