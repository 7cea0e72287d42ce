//! A table of entries addressed by (index, generation) handles: O(1)
//! lookups for the per-record and per-request paths, freed places reused,
//! and a handle to a freed entry never reaching its successor.

/// Entries of type `T`, each under a handle of `(index, generation)`.
#[derive(Debug)]
pub(crate) struct Table<T> {
    slots: Vec<Place<T>>,
    free: Vec<u32>,
    len: usize,
}

#[derive(Debug)]
struct Place<T> {
    generation: u32,
    entry: Option<T>,
}

impl<T> Default for Table<T> {
    fn default() -> Self {
        Table {
            slots: Vec::new(),
            free: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Table<T> {
    /// Inserts the entry `make(generation)` builds; returns its handle.
    pub fn insert(&mut self, make: impl FnOnce(u32) -> T) -> (u32, u32) {
        let index = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(Place {
                    generation: 0,
                    entry: None,
                });
                (self.slots.len() - 1) as u32
            }
        };
        let place = &mut self.slots[index as usize];
        place.generation = place.generation.wrapping_add(1);
        place.entry = Some(make(place.generation));
        self.len += 1;
        (index, place.generation)
    }

    pub fn get(&self, index: u32, generation: u32) -> Option<&T> {
        self.slots
            .get(index as usize)
            .filter(|p| p.generation == generation)
            .and_then(|p| p.entry.as_ref())
    }

    pub fn get_mut(&mut self, index: u32, generation: u32) -> Option<&mut T> {
        self.slots
            .get_mut(index as usize)
            .filter(|p| p.generation == generation)
            .and_then(|p| p.entry.as_mut())
    }

    pub fn remove(&mut self, index: u32, generation: u32) -> Option<T> {
        let place = self
            .slots
            .get_mut(index as usize)
            .filter(|p| p.generation == generation)?;
        let entry = place.entry.take()?;
        self.free.push(index);
        self.len -= 1;
        Some(entry)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Every entry with its handle.
    pub fn iter(&self) -> impl Iterator<Item = ((u32, u32), &T)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.entry.as_ref().map(|e| ((i as u32, p.generation), e)))
    }

    /// Keeps the entries for which `keep` (given each handle and entry)
    /// says true; removes the others.
    pub fn retain(&mut self, mut keep: impl FnMut((u32, u32), &mut T) -> bool) {
        for (i, place) in self.slots.iter_mut().enumerate() {
            let Some(entry) = place.entry.as_mut() else {
                continue;
            };
            if !keep((i as u32, place.generation), entry) {
                place.entry = None;
                self.free.push(i as u32);
                self.len -= 1;
            }
        }
    }

    /// Every entry with its handle, mutably.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = ((u32, u32), &mut T)> {
        self.slots.iter_mut().enumerate().filter_map(|(i, p)| {
            let generation = p.generation;
            p.entry.as_mut().map(|e| ((i as u32, generation), e))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stale_handle_never_reaches_the_next_occupant() {
        let mut t = Table::default();
        let a = t.insert(|_| "a");
        assert_eq!(t.remove(a.0, a.1), Some("a"));
        let b = t.insert(|_| "b");
        assert_eq!(b.0, a.0, "the place is reused");
        assert_eq!(t.get(a.0, a.1), None);
        assert_eq!(t.remove(a.0, a.1), None);
        assert_eq!(t.get(b.0, b.1), Some(&"b"));
        assert_eq!(t.len(), 1);
        assert_eq!(t.iter().count(), 1);
        t.retain(|_, e| *e != "b");
        assert_eq!((t.len(), t.get(b.0, b.1)), (0, None));
    }
}
