//! The order of the concurrency queue: who gets the next free slot, and who is shed when the
//! queue is full. Seed 002: when the queue backs up, protect core traffic first.
//!
//! Requests carry a priority from 0 (least important) to [`MAX_PRIORITY`]. A freed slot
//! goes to the waiter of the highest priority, first come first served within a priority —
//! except that a waiter that has waited [`PriorityQueue::starvation_bound`] is served before
//! every waiter that arrived after it, whatever their priority, so low priorities are slowed
//! under load but never starved. A full queue sheds the lowest priority first: a newcomer of
//! higher priority takes the place of the newest waiter of the lowest priority below its
//! own; a newcomer that is not above anyone waiting is shed itself.
//!
//! Pure: time is passed in; the values stored are whatever the caller uses to wake a
//! waiter.

use std::{collections::VecDeque, time::Duration, time::Instant};

/// The highest priority.
pub const MAX_PRIORITY: u8 = 9;

/// A priority header value that is not one digit `0`–`9`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the {header} header must be one digit, 0 (least important) to 9; got {value:?}")]
pub struct InvalidPriority {
    pub header: String,
    /// The value as sent, cut to 32 bytes.
    pub value: String,
}

/// A request's priority: its header's value if it sent one, else its tier's, else the
/// route's default (all capped at [`MAX_PRIORITY`]).
pub fn choose(
    header: Option<(&str, &[u8])>,
    tier: Option<u8>,
    default: u8,
) -> Result<u8, InvalidPriority> {
    match header {
        Some((_, [d @ b'0'..=b'9'])) => Ok(d - b'0'),
        Some((name, value)) => {
            let shown = &value[..value.len().min(32)];
            Err(InvalidPriority {
                header: name.to_owned(),
                value: String::from_utf8_lossy(shown).into_owned(),
            })
        }
        None => Ok(tier.unwrap_or(default).min(MAX_PRIORITY)),
    }
}

/// One waiter.
#[derive(Debug)]
struct Waiter<T> {
    id: u64,
    arrived: Instant,
    value: T,
}

/// What [`PriorityQueue::push`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Pushed<T> {
    /// Queued under this id (for [`PriorityQueue::remove`]).
    Queued(u64),
    /// Queued; to make room this waiter (of a lower priority) was shed.
    Displaced { id: u64, shed: T, priority: u8 },
    /// The queue is full of waiters of at least this priority: the newcomer is shed.
    Full(T),
}

/// Waiters by priority. See the module docs.
#[derive(Debug)]
pub struct PriorityQueue<T> {
    levels: [VecDeque<Waiter<T>>; MAX_PRIORITY as usize + 1],
    capacity: usize,
    starvation_bound: Duration,
    next_id: u64,
    len: usize,
}

impl<T> PriorityQueue<T> {
    /// A queue of at most `capacity` waiters whose waiters wait at most `starvation_bound`
    /// behind newer ones.
    pub fn new(capacity: usize, starvation_bound: Duration) -> Self {
        Self {
            levels: std::array::from_fn(|_| VecDeque::new()),
            capacity,
            starvation_bound,
            next_id: 0,
            len: 0,
        }
    }

    pub fn starvation_bound(&self) -> Duration {
        self.starvation_bound
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Waiters of each priority, lowest first.
    pub fn counts(&self) -> [usize; MAX_PRIORITY as usize + 1] {
        std::array::from_fn(|p| self.levels[p].len())
    }

    /// Queues `value` at `priority` (capped at [`MAX_PRIORITY`]), shedding the lowest
    /// priority first when the queue is full.
    pub fn push(&mut self, priority: u8, now: Instant, value: T) -> Pushed<T> {
        let priority = priority.min(MAX_PRIORITY) as usize;
        let mut shed = None;
        if self.len >= self.capacity {
            match (0..priority).find(|&p| !self.levels[p].is_empty()) {
                // The newest of the lowest priority goes: it has waited least.
                Some(low) => {
                    if let Some(w) = self.levels[low].pop_back() {
                        self.len -= 1;
                        shed = Some((w.value, low as u8));
                    }
                }
                None => return Pushed::Full(value),
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.levels[priority].push_back(Waiter {
            id,
            arrived: now,
            value,
        });
        self.len += 1;
        match shed {
            Some((shed, priority)) => Pushed::Displaced { id, shed, priority },
            None => Pushed::Queued(id),
        }
    }

    /// The waiter to serve next: the oldest waiter if it has waited the starvation bound,
    /// else the oldest of the highest priority.
    pub fn pop(&mut self, now: Instant) -> Option<(u8, T)> {
        // Ids grow with arrival, so the oldest waiter is the front with the smallest id.
        let oldest = (0..self.levels.len())
            .filter_map(|p| self.levels[p].front().map(|w| (w.id, w.arrived, p)))
            .min_by_key(|(id, _, _)| *id)?;
        let level = if now.saturating_duration_since(oldest.1) >= self.starvation_bound {
            oldest.2
        } else {
            (0..self.levels.len())
                .rev()
                .find(|&p| !self.levels[p].is_empty())?
        };
        let w = self.levels[level].pop_front()?;
        self.len -= 1;
        Some((level as u8, w.value))
    }

    /// Takes a waiter out (it timed out or went away); `None` when it is no longer queued.
    pub fn remove(&mut self, id: u64) -> Option<T> {
        for level in &mut self.levels {
            if let Some(pos) = level.iter().position(|w| w.id == id) {
                self.len -= 1;
                return level.remove(pos).map(|w| w.value);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn the_header_wins_then_the_tier_then_the_default() {
        let h = |v: &'static str| Some(("x-priority", v.as_bytes()));
        assert_eq!(choose(h("7"), Some(2), 5), Ok(7));
        assert_eq!(choose(h("0"), None, 5), Ok(0));
        assert_eq!(choose(None, Some(2), 5), Ok(2));
        assert_eq!(choose(None, None, 5), Ok(5));
        assert_eq!(choose(None, Some(200), 5), Ok(MAX_PRIORITY));
        for bad in ["10", "", " 1", "high", "-1", "٣"] {
            let e = choose(h(bad), None, 5).unwrap_err();
            assert_eq!(e.value, bad);
            assert_eq!(
                e.to_string(),
                format!(
                    "the x-priority header must be one digit, 0 (least important) to 9; got {bad:?}"
                )
            );
        }
        let long = "9".repeat(100);
        assert_eq!(
            choose(Some(("p", long.as_bytes())), None, 5)
                .unwrap_err()
                .value
                .len(),
            32
        );
    }

    #[test]
    fn higher_priorities_first_fifo_within_one() {
        let t0 = Instant::now();
        let mut q = PriorityQueue::new(10, ms(1000));
        q.push(1, t0, "low-a");
        q.push(5, t0 + ms(1), "high-a");
        q.push(1, t0 + ms(2), "low-b");
        q.push(5, t0 + ms(3), "high-b");
        q.push(9, t0 + ms(4), "top");
        let now = t0 + ms(10);
        let order: Vec<&str> = std::iter::from_fn(|| q.pop(now).map(|(_, v)| v)).collect();
        assert_eq!(order, ["top", "high-a", "high-b", "low-a", "low-b"]);
        assert!(q.is_empty());
    }

    #[test]
    fn a_waiter_past_the_starvation_bound_goes_before_newer_ones() {
        let t0 = Instant::now();
        let mut q = PriorityQueue::new(10, ms(100));
        q.push(0, t0, "old-low");
        q.push(9, t0 + ms(50), "high-1");
        q.push(9, t0 + ms(60), "high-2");
        assert_eq!(q.pop(t0 + ms(99)), Some((9, "high-1")), "within the bound");
        assert_eq!(q.pop(t0 + ms(100)), Some((0, "old-low")), "bound reached");
        assert_eq!(q.pop(t0 + ms(100)), Some((9, "high-2")));
    }

    #[test]
    fn starvation_is_bounded_under_a_steady_stream_of_high_priority() {
        // One slot frees every 10 ms; a high-priority request arrives every 5 ms (twice
        // what is served), a low one once. The low one is served once it waited the bound.
        let t0 = Instant::now();
        let bound = ms(200);
        let mut q = PriorityQueue::new(1000, bound);
        q.push(0, t0, "low");
        let mut served_low_at = None;
        for step in 0..200u64 {
            let now = t0 + ms(step * 5);
            q.push(9, now, "high");
            if step % 2 == 1 && q.pop(now).is_some_and(|(_, v)| v == "low") {
                served_low_at = Some(now - t0);
                break;
            }
        }
        let waited = served_low_at.expect("the low request was served");
        assert!(waited >= bound && waited <= bound + ms(10), "{waited:?}");
    }

    #[test]
    fn a_full_queue_sheds_the_lowest_priority_first() {
        let t0 = Instant::now();
        let mut q = PriorityQueue::new(3, ms(1000));
        assert_eq!(q.push(2, t0, "a"), Pushed::Queued(0));
        assert_eq!(q.push(0, t0, "b"), Pushed::Queued(1));
        assert_eq!(q.push(0, t0, "c"), Pushed::Queued(2));
        // Full. A high newcomer displaces the newest of the lowest priority.
        assert_eq!(
            q.push(5, t0, "d"),
            Pushed::Displaced {
                id: 3,
                shed: "c",
                priority: 0
            }
        );
        // Not above anyone but "b" (0)? It is above "b": "b" goes.
        assert_eq!(
            q.push(1, t0, "e"),
            Pushed::Displaced {
                id: 4,
                shed: "b",
                priority: 0
            }
        );
        // Now the lowest waiting is 1 ("e"); a newcomer at 1 is not above it: shed itself.
        assert_eq!(q.push(1, t0, "f"), Pushed::Full("f"));
        assert_eq!(q.counts()[..6], [0, 1, 1, 0, 0, 1]);
        assert_eq!(q.len(), 3);
    }

    #[test]
    fn removed_waiters_are_gone_and_priorities_are_capped() {
        let t0 = Instant::now();
        let mut q = PriorityQueue::new(3, ms(1000));
        let Pushed::Queued(a) = q.push(200, t0, "a") else {
            panic!()
        };
        q.push(3, t0, "b");
        assert_eq!(q.remove(a), Some("a"));
        assert_eq!(q.remove(a), None);
        assert_eq!(q.len(), 1);
        assert_eq!(q.pop(t0), Some((3, "b")));
        assert_eq!(q.pop(t0), None);
    }
}
