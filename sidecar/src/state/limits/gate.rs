//! A concurrency limit whose queue is served by priority: the I/O around
//! [`tailwarden_decide::priority::PriorityQueue`] (the order, the starvation bound and who
//! is shed when the queue is full). A waiter parks on a oneshot channel; a slot handed over
//! on release goes straight to the waiter the queue names, so a newcomer never jumps the
//! queue.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use tailwarden_decide::priority::{MAX_PRIORITY, PriorityQueue, Pushed};
use tokio::{sync::oneshot, time::Instant};

/// What a parked waiter is told.
#[derive(Debug)]
enum Signal {
    /// A slot is yours (already counted in `in_use`).
    Granted,
    /// A newcomer of higher priority took your place in a full queue.
    Shed,
}

#[derive(Debug)]
struct State {
    in_use: u32,
    queue: PriorityQueue<oneshot::Sender<Signal>>,
}

/// A concurrency limit with a bounded priority queue.
#[derive(Debug)]
pub struct Gate {
    limit: u32,
    state: Mutex<State>,
}

/// Why a waiter got no slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The queue was full of waiters at least as important (`queued` of them).
    Full { queued: usize },
    /// Shed from the queue for a more important newcomer.
    Displaced,
    /// No slot freed within the wait.
    Timeout,
}

/// A slot, released on drop (and handed to the next waiter).
#[derive(Debug)]
pub struct GatePermit {
    gate: Arc<Gate>,
}

impl Drop for GatePermit {
    fn drop(&mut self) {
        self.gate.release();
    }
}

impl Gate {
    pub fn new(limit: u32, max_queued: usize, starvation_bound: Duration) -> Self {
        Self {
            limit,
            state: Mutex::new(State {
                in_use: 0,
                queue: PriorityQueue::new(max_queued, starvation_bound),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Plain counters and a queue: a panic elsewhere cannot leave them half-updated.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Slots in use and waiters.
    pub fn usage(&self) -> (usize, usize) {
        let s = self.lock();
        (s.in_use as usize, s.queue.len())
    }

    /// Waiters per priority, lowest first.
    pub fn queued_by_priority(&self) -> [usize; MAX_PRIORITY as usize + 1] {
        self.lock().queue.counts()
    }

    /// A slot at `priority`, waiting up to `timeout` in the queue.
    pub async fn acquire(
        self: &Arc<Self>,
        priority: u8,
        timeout: Duration,
    ) -> Result<(GatePermit, Duration), Refused> {
        let started = Instant::now();
        let (tx, rx) = oneshot::channel();
        let id = {
            let mut s = self.lock();
            if s.in_use < self.limit && s.queue.is_empty() {
                s.in_use += 1;
                return Ok((GatePermit { gate: self.clone() }, Duration::ZERO));
            }
            match s.queue.push(priority, started.into_std(), tx) {
                Pushed::Queued(id) => id,
                Pushed::Displaced { id, shed, .. } => {
                    // The shed waiter may be gone already; nothing to do then.
                    let _ = shed.send(Signal::Shed);
                    id
                }
                Pushed::Full(_) => {
                    return Err(Refused::Full {
                        queued: s.queue.len(),
                    });
                }
            }
        };
        let mut parked = Parked {
            gate: self,
            id,
            rx,
            settled: false,
        };
        // A slot may have freed between the check and the push (or the queue held only
        // waiters that left): let the queue's order decide now.
        self.dispatch();
        let outcome = tokio::time::timeout(timeout, &mut parked.rx).await;
        parked.settled = true;
        let granted = || Ok((GatePermit { gate: self.clone() }, started.elapsed()));
        match outcome {
            Ok(Ok(Signal::Granted)) => granted(),
            Ok(Ok(Signal::Shed)) => Err(Refused::Displaced),
            // The sender is dropped only when its entry is removed, which only we do.
            Ok(Err(_)) => Err(Refused::Timeout),
            Err(_) => {
                if self.lock().queue.remove(id).is_some() {
                    return Err(Refused::Timeout);
                }
                // Not queued any more: granted or shed in the very moment the wait ended.
                match parked.rx.try_recv() {
                    Ok(Signal::Granted) => granted(),
                    Ok(Signal::Shed) => Err(Refused::Displaced),
                    Err(_) => Err(Refused::Timeout),
                }
            }
        }
    }

    /// Hands free slots to the waiters the queue names.
    fn dispatch(&self) {
        let mut s = self.lock();
        while s.in_use < self.limit {
            let Some((_, tx)) = s.queue.pop(Instant::now().into_std()) else {
                break;
            };
            s.in_use += 1;
            if tx.send(Signal::Granted).is_err() {
                // That waiter went away (its request was cancelled): the slot is still free.
                s.in_use -= 1;
            }
        }
    }

    fn release(&self) {
        {
            let mut s = self.lock();
            s.in_use = s.in_use.saturating_sub(1);
        }
        self.dispatch();
    }
}

/// A queued waiter. Dropped while still waiting (the client went away), it leaves the queue,
/// and a slot granted in that moment is handed on instead of leaking.
struct Parked<'a> {
    gate: &'a Arc<Gate>,
    id: u64,
    rx: oneshot::Receiver<Signal>,
    settled: bool,
}

impl Drop for Parked<'_> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let removed = self.gate.lock().queue.remove(self.id);
        if removed.is_none()
            && let Ok(Signal::Granted) = self.rx.try_recv()
        {
            self.gate.release();
        }
    }
}
