//! A byte-bounded LRU index keyed by chunk digest, used by both cache tiers.

use std::collections::{BTreeMap, HashMap};

use sealed_store::Digest;

struct Slot<V> {
    value: V,
    len: u64,
    tick: u64,
}

pub(crate) struct LruIndex<V> {
    entries: HashMap<Digest, Slot<V>>,
    /// Least recently used first.
    order: BTreeMap<u64, Digest>,
    tick: u64,
    bytes: u64,
    capacity: u64,
}

/// What an insert did.
pub(crate) enum Inserted<V> {
    /// Stored; these entries were evicted to make room.
    Stored(Vec<(Digest, V)>),
    /// Already present (touched; the new value is dropped).
    Present,
    /// Larger than the whole capacity: not stored.
    TooLarge,
}

impl<V> LruIndex<V> {
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
    pub fn get(&mut self, digest: &Digest) -> Option<&V> {
        let tick = self.next_tick();
        let slot = self.entries.get_mut(digest)?;
        self.order.remove(&slot.tick);
        slot.tick = tick;
        self.order.insert(tick, *digest);
        Some(&slot.value)
    }

    pub fn contains(&self, digest: &Digest) -> bool {
        self.entries.contains_key(digest)
    }

    pub fn insert(&mut self, digest: Digest, value: V, len: u64) -> Inserted<V> {
        if self.get(&digest).is_some() {
            return Inserted::Present;
        }
        if len > self.capacity {
            return Inserted::TooLarge;
        }
        let mut evicted = Vec::new();
        while self.bytes + len > self.capacity {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            if let Some(slot) = self.entries.remove(&oldest) {
                self.bytes -= slot.len;
                evicted.push((oldest, slot.value));
            }
        }
        let tick = self.next_tick();
        self.order.insert(tick, digest);
        self.entries.insert(digest, Slot { value, len, tick });
        self.bytes += len;
        Inserted::Stored(evicted)
    }

    pub fn remove(&mut self, digest: &Digest) -> Option<V> {
        let slot = self.entries.remove(digest)?;
        self.order.remove(&slot.tick);
        self.bytes -= slot.len;
        Some(slot.value)
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

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
