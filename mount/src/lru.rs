//! A byte-bounded LRU index, used by both cache tiers (keyed by chunk digest in memory, by
//! chunk or assembled file on disk).

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::time::Instant;

#[cfg(test)]
use sealed_store::Digest;

struct Slot<V> {
    value: V,
    len: u64,
    tick: u64,
    /// When it was last stored or looked up (warming spares recently used entries).
    used: Instant,
}

pub(crate) struct LruIndex<K, V> {
    entries: HashMap<K, Slot<V>>,
    /// Least recently used first.
    order: BTreeMap<u64, K>,
    tick: u64,
    bytes: u64,
    capacity: u64,
}

/// What an insert did.
pub(crate) enum Inserted<K, V> {
    /// Stored; these entries were evicted to make room.
    Stored(Vec<(K, V)>),
    /// Already present (touched; the new value is dropped).
    Present,
    /// Larger than the whole capacity: not stored.
    TooLarge,
}

impl<K: Copy + Eq + Hash, V> LruIndex<K, V> {
    pub fn new(capacity: u64) -> Self {
        LruIndex {
            entries: HashMap::new(),
            order: BTreeMap::new(),
            tick: 0,
            bytes: 0,
            capacity,
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// Looks up and marks as most recently used.
    pub fn get(&mut self, digest: &K) -> Option<&V> {
        let tick = self.next_tick();
        let slot = self.entries.get_mut(digest)?;
        self.order.remove(&slot.tick);
        slot.tick = tick;
        slot.used = Instant::now();
        self.order.insert(tick, *digest);
        Some(&slot.value)
    }

    pub fn contains(&self, digest: &K) -> bool {
        self.entries.contains_key(digest)
    }

    pub fn insert(&mut self, digest: K, value: V, len: u64) -> Inserted<K, V> {
        self.insert_unless(digest, value, len, |_| false)
    }

    /// [`LruIndex::insert`], never evicting an entry for which `pinned` is true: if the
    /// unpinned entries cannot make room, nothing is evicted and the entry is `TooLarge`.
    pub fn insert_unless(
        &mut self,
        digest: K,
        value: V,
        len: u64,
        pinned: impl Fn(&K) -> bool,
    ) -> Inserted<K, V> {
        self.insert_sparing(digest, value, len, |k, _| pinned(k))
    }

    /// [`LruIndex::insert`], never evicting an entry for which `spare(key, last used)` is
    /// true: if the others cannot make room, nothing is evicted and the entry is `TooLarge`.
    pub fn insert_sparing(
        &mut self,
        digest: K,
        value: V,
        len: u64,
        spare: impl Fn(&K, Instant) -> bool,
    ) -> Inserted<K, V> {
        if self.get(&digest).is_some() {
            return Inserted::Present;
        }
        if len > self.capacity {
            return Inserted::TooLarge;
        }
        // Victims in LRU order, skipping pinned entries, until the new entry fits.
        let mut victims = Vec::new();
        let mut freed = 0u64;
        for (&tick, key) in &self.order {
            if self.bytes - freed + len <= self.capacity {
                break;
            }
            if let Some(slot) = self.entries.get(key) {
                if spare(key, slot.used) {
                    continue;
                }
                freed += slot.len;
                victims.push(tick);
            }
        }
        if self.bytes - freed + len > self.capacity {
            return Inserted::TooLarge;
        }
        let mut evicted = Vec::new();
        for tick in victims {
            let Some(oldest) = self.order.remove(&tick) else {
                continue;
            };
            if let Some(slot) = self.entries.remove(&oldest) {
                self.bytes -= slot.len;
                evicted.push((oldest, slot.value));
            }
        }
        let tick = self.next_tick();
        self.order.insert(tick, digest);
        self.entries.insert(
            digest,
            Slot {
                value,
                len,
                tick,
                used: Instant::now(),
            },
        );
        self.bytes += len;
        Inserted::Stored(evicted)
    }

    pub fn remove(&mut self, digest: &K) -> Option<V> {
        let slot = self.entries.remove(digest)?;
        self.order.remove(&slot.tick);
        self.bytes -= slot.len;
        Some(slot.value)
    }

    /// Every key, least recently used first.
    pub fn keys(&self) -> Vec<K> {
        self.order.values().copied().collect()
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The entry's value, without marking it used.
    pub fn peek(&self, digest: &K) -> Option<&V> {
        self.entries.get(digest).map(|slot| &slot.value)
    }

    pub fn peek_mut(&mut self, digest: &K) -> Option<&mut V> {
        self.entries.get_mut(digest).map(|slot| &mut slot.value)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn pinned_entries_are_never_evicted() {
        let mut lru = LruIndex::new(10);
        lru.insert(d(1), (), 4);
        lru.insert(d(2), (), 4);
        let pinned = d(1);
        let Inserted::Stored(evicted) = lru.insert_unless(d(3), (), 4, |k| *k == pinned) else {
            panic!("not stored");
        };
        assert_eq!(evicted.len(), 1);
        assert_eq!(evicted[0].0, d(2));
        // Only pinned entries left to evict: refused, nothing evicted.
        assert!(matches!(
            lru.insert_unless(d(4), (), 8, |_| true),
            Inserted::TooLarge
        ));
        assert!(lru.contains(&d(1)) && lru.contains(&d(3)));
    }

    fn d(i: u32) -> Digest {
        Digest::of(&i.to_le_bytes())
    }

    #[test]
    fn evicts_least_recently_used_first() {
        let mut lru = LruIndex::new(10);
        assert!(matches!(lru.insert(d(1), (), 4), Inserted::Stored(v) if v.is_empty()));
        assert!(matches!(lru.insert(d(2), (), 4), Inserted::Stored(v) if v.is_empty()));
        lru.get(&d(1));
        let Inserted::Stored(evicted) = lru.insert(d(3), (), 4) else {
            panic!("not stored");
        };
        assert_eq!(evicted.len(), 1);
        assert_eq!(evicted[0].0, d(2));
        assert!(lru.contains(&d(1)) && lru.contains(&d(3)));
        assert!(matches!(lru.insert(d(4), (), 11), Inserted::TooLarge));
        assert!(matches!(lru.insert(d(1), (), 4), Inserted::Present));
    }

    proptest! {
        #[test]
        fn never_exceeds_capacity(ops in proptest::collection::vec((0u32..20, 0u64..50, any::<bool>()), 1..200)) {
            let mut lru = LruIndex::new(100);
            for (key, len, remove) in ops {
                if remove {
                    lru.remove(&d(key));
                } else {
                    lru.insert(d(key), (), len);
                }
                prop_assert!(lru.bytes() <= 100);
            }
        }
    }
}
