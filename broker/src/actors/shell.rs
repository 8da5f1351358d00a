//! What the actors' shells share: one timer, one disk worker, one group commit, written once.
//!
//! A core shell (partition, metadata, elector) turns each input into a `handle_*` call on its
//! core, then drains the core's outputs in one `drive()`. The three pieces here are what
//! `drive()` needs besides the outputs themselves:
//!
//! - [`Timer`]: the core's `poll_timeout()` re-armed after every input, never cancelled;
//! - [`DiskWorker`]: a named thread that does disk work (an fsync, a file's close, a copy) off
//!   the actor's thread and answers through the actor's mailbox;
//! - [`GroupCommit`]: a flush asked for by a message the actor sends itself, so every request
//!   already in the mailbox is written before the one fsync that covers them all.

use std::sync::mpsc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use actix::{Actor, AsyncContext, Context, Handler, Message};

/// An actor's one timer, armed at the core's `poll_timeout()` after every input.
///
/// It is armed only when no timer is pending for an earlier time, and never cancelled:
/// cancelling actix futures on every message starves them while the mailbox stays busy, so a
/// core whose deadline keeps moving would never see its timeout. A timer that fires after the
/// deadline moved later is harmless: a core's `handle_timeout(now)` acts only on what is due at
/// `now`, and the next `drive()` arms the new deadline.
#[derive(Debug, Default)]
pub struct Timer {
    /// The time of the earliest pending timer, if one is pending.
    at: Option<Instant>,
}

impl Timer {
    /// A timer with nothing pending.
    pub fn new() -> Self {
        Timer { at: None }
    }

    /// Arms a timer for `at` (the core's `poll_timeout()`; `None`: nothing to arm) unless one
    /// is pending for the same or an earlier time. When it fires, `on_fire` runs on the actor;
    /// `timer` finds this timer in the actor, to note that it no longer waits.
    pub fn arm<A>(
        &mut self,
        ctx: &mut Context<A>,
        at: Option<Instant>,
        timer: fn(&mut A) -> &mut Timer,
        on_fire: fn(&mut A, &mut Context<A>),
    ) where
        A: Actor<Context = Context<A>>,
    {
        let Some(at) = at else {
            return;
        };
        if self.at.is_some_and(|pending| pending <= at) {
            return;
        }
        self.at = Some(at);
        let wait = at.saturating_duration_since(Instant::now());
        ctx.run_later(wait, move |actor, ctx| {
            // Only the timer that `at` names clears it: a stale one (armed for a later time,
            // then overtaken by an earlier one) fires without forgetting the newer pending one.
            let timer = timer(actor);
            if timer.at == Some(at) {
                timer.at = None;
            }
            on_fire(actor, ctx);
        });
    }
}

/// A named thread that runs an actor's disk work in order, one job at a time, fed by a
/// channel; it ends when the worker (the channel's sender, held by the actor) is dropped.
///
/// The actor bounds what it sends (one fsync in flight, one compaction at a time): the
/// channel itself has no limit. The work answers the actor through its address (`do_send` is
/// rate-bounded there: one answer per job).
pub struct DiskWorker<T> {
    /// The thread's queue; `None` when the thread could not start.
    jobs: Option<mpsc::Sender<T>>,
}

impl<T: Send + 'static> DiskWorker<T> {
    /// Starts thread `name`, which hands every job sent to it to `work`. When the thread cannot
    /// start, the failure is logged and the worker has no thread: [`DiskWorker::send`] gives
    /// every job back, for the actor to run on its own thread or to stop on.
    pub fn start(name: String, mut work: impl FnMut(T) + Send + 'static) -> Self {
        let (tx, rx) = mpsc::channel::<T>();
        let spawned = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    work(job);
                }
            });
        match spawned {
            Ok(_) => DiskWorker { jobs: Some(tx) },
            Err(e) => {
                tracing::warn!(thread = %name, error = %e, "cannot start a disk worker thread: the actor's thread does its work");
                DiskWorker::none()
            }
        }
    }

    /// A worker without a thread (before the actor starts one): every job is given back.
    pub fn none() -> Self {
        DiskWorker { jobs: None }
    }

    /// Whether the thread runs (it started and has not ended).
    pub fn is_running(&self) -> bool {
        self.jobs.is_some()
    }

    /// Hands `job` to the thread.
    ///
    /// # Errors
    /// Gives `job` back when there is no thread: it could not start, or it ended (after a panic
    /// in its work).
    pub fn send(&self, job: T) -> Result<(), T> {
        match &self.jobs {
            Some(jobs) => jobs.send(job).map_err(|e| e.0),
            None => Err(job),
        }
    }
}

/// Group commit: a flush that runs after the requests already in the actor's mailbox, so one
/// fsync (and one message per peer) covers them all.
///
/// The flush is a message the actor sends itself, to the back of its mailbox. It was chosen
/// over a spawned future (`ctx.spawn`), which actix polls only once the mailbox is empty: under
/// a steady stream of requests that future waits, and so does every ack behind it, while the
/// self-sent message waits only for what was queued before it. A full mailbox cannot take the
/// message; then the flush runs at once. Either way nothing depending on durability is released
/// by the flush itself: it starts the fsync, and only the fsync's answer tells the core
/// `on_persisted`.
#[derive(Debug, Default)]
pub struct GroupCommit {
    /// The flush message is in the mailbox.
    queued: bool,
}

impl GroupCommit {
    /// No flush asked for.
    pub fn new() -> Self {
        GroupCommit { queued: false }
    }

    /// Asks for a flush: sends `flush` to the actor itself unless one is already queued.
    /// Returns true when the mailbox is full (or closed): the caller flushes now.
    pub fn request<A, M>(&mut self, ctx: &mut Context<A>, flush: M) -> bool
    where
        A: Actor<Context = Context<A>> + Handler<M>,
        M: Message<Result = ()> + Send + 'static,
    {
        if self.queued {
            return false;
        }
        if ctx.address().try_send(flush).is_ok() {
            self.queued = true;
            false
        } else {
            true
        }
    }

    /// The flush starts (from the flush message's handler, or at once when the mailbox was
    /// full): returns whether one was queued, and lets the next request queue another.
    pub fn take(&mut self) -> bool {
        std::mem::take(&mut self.queued)
    }
}

/// Wall-clock milliseconds since the Unix epoch (0 for a clock before it): the anchor of the
/// cores' record timestamps, read only by the shells (the cores read no clock).
pub fn wall_clock_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::*;

    /// Records when its timer fires.
    struct Ticker {
        timer: Timer,
        fired: Arc<Mutex<Vec<Instant>>>,
    }

    impl Actor for Ticker {
        type Context = Context<Self>;
    }

    impl Ticker {
        fn on_fire(&mut self, _ctx: &mut Context<Self>) {
            self.fired.lock().unwrap().push(Instant::now());
        }
    }

    /// Arms the ticker's timer at `at`.
    #[derive(Message)]
    #[rtype(result = "()")]
    struct ArmAt {
        at: Instant,
    }

    impl Handler<ArmAt> for Ticker {
        type Result = ();

        fn handle(&mut self, msg: ArmAt, ctx: &mut Self::Context) {
            self.timer
                .arm(ctx, Some(msg.at), |a| &mut a.timer, Self::on_fire);
        }
    }

    #[actix_rt::test]
    async fn a_timer_is_armed_once_per_earlier_deadline_and_never_cancelled() {
        // Scenario: the deadline is asked for three times (later, the same, earlier); the
        // later and the same are covered by the pending timer, the earlier arms a second one,
        // and both fire.
        let fired = Arc::new(Mutex::new(Vec::new()));
        let actor = Ticker {
            timer: Timer::new(),
            fired: fired.clone(),
        }
        .start();
        let now = Instant::now();
        let first = now + Duration::from_millis(40);
        for at in [first, first + Duration::from_millis(20), first] {
            actor.send(ArmAt { at }).await.unwrap();
        }
        actor
            .send(ArmAt {
                at: now + Duration::from_millis(10),
            })
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while fired.lock().unwrap().len() < 2 && Instant::now() < deadline {
            actix_rt::time::sleep(Duration::from_millis(5)).await;
        }
        actix_rt::time::sleep(Duration::from_millis(30)).await;
        let fired = fired.lock().unwrap().clone();
        assert_eq!(fired.len(), 2, "{fired:?}");
        assert!(fired[0] >= now + Duration::from_millis(10));
        assert!(fired[1] >= first);
    }

    #[test]
    fn a_disk_worker_runs_jobs_in_order_and_gives_them_back_without_a_thread() {
        // Scenario: three jobs run on the worker's thread in the order sent; a worker without
        // a thread gives its job back.
        let (tx, rx) = mpsc::channel();
        let worker = DiskWorker::start("bmq-test-worker".into(), move |n: u32| {
            tx.send((n, std::thread::current().name().map(String::from)))
                .unwrap();
        });
        assert!(worker.is_running());
        for n in 0..3 {
            worker.send(n).unwrap();
        }
        let done: Vec<_> = (0..3).map(|_| rx.recv().unwrap()).collect();
        let name = Some("bmq-test-worker".to_string());
        assert_eq!(done, vec![(0, name.clone()), (1, name.clone()), (2, name)]);
        let none = DiskWorker::<u32>::none();
        assert!(!none.is_running());
        assert_eq!(none.send(7), Err(7));
    }
}
