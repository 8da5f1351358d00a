//! `QueueCore`: the pure core of a priority-mode queue on a partition's primary (DESIGN.md §7).
//!
//! No I/O, no clock: the caller passes `now`. Inputs are [`QueueCore::put`],
//! [`QueueCore::add_consumer`], [`QueueCore::remove_consumer`],
//! [`QueueCore::remove_consumers_of_node`], [`QueueCore::confirm`],
//! [`QueueCore::set_deliverable_through`] and [`QueueCore::purge`]; the pushes to make are
//! drained with [`QueueCore::poll_delivery`] until it returns `None`, and what the partition must
//! journal and report (consumer failures, removals without a confirm) with
//! [`QueueCore::poll_event`].
//!
//! Delivery rules (BlazingMQ's priority mode):
//! - Only the consumers with the **highest** priority receive messages, round-robin among them.
//!   A lower-priority consumer gets nothing while a higher-priority consumer is attached, even
//!   when every higher-priority consumer is at capacity: it is a standby, not an overflow.
//! - A consumer has capacity for a message when its unconfirmed count is below
//!   `max_unconfirmed_messages`, and its unconfirmed bytes plus the message's payload stay within
//!   `max_unconfirmed_bytes` — or it has nothing unconfirmed at all, so that a message larger
//!   than the byte limit still flows, one at a time.
//! - Messages are delivered in arrival order, and only once they are *deliverable*: each message
//!   carries the journal sequence of its record, and the partition raises the deliverable mark
//!   when a quorum holds the records (strong consistency) or the primary does (eventual), so a
//!   consumer never reads what a failover could lose (DESIGN.md §7).
//! - When a consumer goes away, its unconfirmed messages return to the head of the queue (in
//!   their arrival order) and are redelivered (at-least-once). `delivery_attempt` is one plus
//!   the number of *consumer failures* of the message: a consumer that went away (or closed the
//!   queue) holding it. A consumer released for another reason — its proxy node's link dropped,
//!   its node is stopping, the primary moved — does not count (BlazingMQ's redelivery-attempt
//!   counter, with the failure rule of DESIGN.md §7).
//! - A message whose consumer failures reach `max_delivery_attempts` (0 = unlimited) is removed
//!   (a poison message); one older than `message_ttl` when it reaches the head is removed too;
//!   [`QueueCore::purge`] removes everything. Each removal without a confirm is an event
//!   ([`QueueEvent::Removed`]) the partition journals, logs and counts: nothing is dropped
//!   silently.
//!
//! Memory: the queue holds no payloads — each message is its GUID, the journal position of its
//! record (the partition reads the payload back from the journal to push it), its arrival, size
//! and attempt count: 40 bytes per pending message, in one `VecDeque` in delivery order grown
//! by a quarter at a time (no hash table: a queue of 1,000,000 pending messages takes 40 to 50
//! MB, DESIGN.md §7, "Storage for months"). Only pushed, unconfirmed messages are in a table by GUID, per consumer, so that a
//! confirm finds them; there are at most the consumers' `max_unconfirmed_messages` of those.
//! The deque gives memory back once it is mostly empty.
//!
//! The queue does not look for duplicate GUIDs: its caller never stores a GUID twice (the
//! partition checks the journal's index first, and every message a queue holds is outstanding
//! there).
//!
//! Costs: `put`, `confirm` and each `poll_delivery` step are O(1) in the queue depth and O(k) in
//! the number k of highest-priority consumers. `remove_consumer` is O(u log u) in that
//! consumer's unconfirmed messages; `purge` is O(n log n) in the depth.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use foldhash::quality::RandomState;

use bmq_proto::client::AckStatus;
use bmq_proto::{NodeId, SessionAddr};

/// A consumer's priority and flow control, as resolved by the primary (no "0 = default" here:
/// the caller replaces zeros by the broker's defaults before calling the core).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConsumerOptions {
    /// Higher receives first; only the highest priority present receives at all.
    pub priority: i32,
    /// Most messages pushed to this consumer and not yet confirmed. 0 means it receives nothing.
    pub max_unconfirmed_messages: u32,
    /// Most payload bytes pushed to this consumer and not yet confirmed (a lone message larger
    /// than this is still delivered when nothing else is unconfirmed).
    pub max_unconfirmed_bytes: u64,
}

/// A queue's limits, from its domain's configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueLimits {
    /// Most messages held (pending plus unconfirmed); 0 = unlimited.
    pub max_messages: u64,
    /// Most payload bytes held (pending plus unconfirmed); 0 = unlimited.
    pub max_bytes: u64,
    /// Most deliveries of one message; 0 = unlimited.
    pub max_delivery_attempts: u32,
    /// Age (since `put`) after which an undelivered message is dropped; `None` = never.
    pub message_ttl: Option<Duration>,
}

/// One push to make: send the message of journal record `journal_sequence` to `consumer`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// Who receives it.
    pub consumer: SessionAddr,
    /// The message's GUID as a key (`store::guid_key`).
    pub guid: u128,
    /// The journal position of the message's record (payload and properties are read from
    /// there).
    pub journal_sequence: u64,
    /// 1 plus the number of consumer failures of this message (see the module doc).
    pub delivery_attempt: u32,
    /// The message may have been delivered before: it was released by a consumer (for any
    /// reason) or restored by a new primary, so it may overtake later messages.
    pub out_of_order: bool,
}

/// Why a message left the queue without a confirm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RemovalReason {
    /// Older than the domain's `message_ttl` when it reached the head of the queue.
    Ttl,
    /// Its consumer failures reached the domain's `max_delivery_attempts` (a poison message).
    AttemptsExhausted,
    /// Removed by an operator's purge of the queue.
    Purged,
}

impl RemovalReason {
    /// `ttl`, `attempts_exhausted` or `purged` (metric label, log field, journal value).
    pub fn as_str(self) -> &'static str {
        match self {
            RemovalReason::Ttl => "ttl",
            RemovalReason::AttemptsExhausted => "attempts_exhausted",
            RemovalReason::Purged => "purged",
        }
    }
}

/// What the partition must journal and report, drained with [`QueueCore::poll_event`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QueueEvent {
    /// A consumer holding `guid` went away without confirming it: a consumer failure. The
    /// message goes back to the head of the queue with `failures` failures so far.
    ConsumerFailed {
        /// The message (`store::guid_key`).
        guid: u128,
        /// Consumer failures of this message so far (at least 1).
        failures: u32,
    },
    /// `guid` left the queue without a confirm.
    Removed {
        /// The message (`store::guid_key`).
        guid: u128,
        /// Why.
        reason: RemovalReason,
    },
}

/// What [`QueueCore::put`] did with a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PutOutcome {
    /// Stored; the producer may be acknowledged.
    Accepted,
    /// Not stored; NACK the producer with `status` and `reason`.
    Refused {
        /// The ack status to answer with (`LIMIT_REACHED` for depth limits).
        status: AckStatus,
        /// Human-readable reason, naming the limit and its value.
        reason: String,
    },
}

/// Counters of one queue since it was created (monotonic).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueCounters {
    /// Messages accepted by `put`.
    pub puts: u64,
    /// Puts refused by a depth limit.
    pub refused: u64,
    /// Deliveries made (first deliveries and redeliveries).
    pub pushes: u64,
    /// Messages confirmed.
    pub confirms: u64,
    /// Deliveries with `delivery_attempt > 1`.
    pub redeliveries: u64,
    /// Messages dropped because they were older than the TTL.
    pub ttl_expired: u64,
    /// Messages dropped because they reached `max_delivery_attempts`.
    pub attempts_exhausted: u64,
    /// Messages removed by a purge.
    pub purged: u64,
    /// Consumer failures (a consumer went away holding a message), one per message released.
    pub consumer_failures: u64,
}

/// A message held by the queue: 40 bytes, for the memory of a primary with millions of
/// outstanding messages (issue 17). A pending message is one entry of the pending deque; a
/// pushed one is in its consumer's table ([`Consumer::unconfirmed`]).
#[derive(Debug, Clone, Copy)]
struct Held {
    /// The GUID ([`Held::guid`]) as two words: a `u128` field would align the struct to 16
    /// bytes and make it 48.
    guid: [u64; 2],
    /// Journal sequence of the message's record: deliverable once at or below the mark, and
    /// the arrival order (redelivered messages go back in this order).
    journal_sequence: u64,
    /// Arrival, in nanoseconds after the queue's epoch (its first message).
    arrival_ns: u64,
    /// Payload bytes.
    size: u32,
    /// Consumer failures so far (see the module doc) in the low 31 bits; [`OUT_OF_ORDER`] when
    /// it was released by a consumer or restored from the journal, so it may have been
    /// delivered before.
    failures_flags: u32,
}

/// The out-of-order bit of [`Held::failures_flags`].
const OUT_OF_ORDER: u32 = 1 << 31;

impl Held {
    fn new(guid: u128, journal_sequence: u64, arrival_ns: u64, size: u32) -> Held {
        Held {
            guid: [(guid >> 64) as u64, guid as u64],
            journal_sequence,
            arrival_ns,
            size,
            failures_flags: 0,
        }
    }

    fn guid(&self) -> u128 {
        (u128::from(self.guid[0]) << 64) | u128::from(self.guid[1])
    }

    fn failures(&self) -> u32 {
        self.failures_flags & !OUT_OF_ORDER
    }

    /// Sets the failure count (at most 2^31 - 1, far beyond any attempt limit).
    fn set_failures(&mut self, failures: u32) {
        self.failures_flags = (self.failures_flags & OUT_OF_ORDER) | failures.min(!OUT_OF_ORDER);
    }

    fn out_of_order(&self) -> bool {
        self.failures_flags & OUT_OF_ORDER != 0
    }

    fn set_out_of_order(&mut self) {
        self.failures_flags |= OUT_OF_ORDER;
    }
}

#[derive(Debug)]
struct Consumer {
    options: ConsumerOptions,
    unconfirmed_bytes: u64,
    /// The messages pushed to this consumer and not yet confirmed, by GUID (hashed with
    /// foldhash's keyed `quality::RandomState`, as the GUID index: one insert and one remove per
    /// message, where std's SipHash cost ~2% of the primary's partition thread).
    unconfirmed: HashMap<u128, Held, RandomState>,
}

impl Consumer {
    fn has_capacity_for(&self, size: u64) -> bool {
        let count = self.unconfirmed.len() as u64;
        if count >= u64::from(self.options.max_unconfirmed_messages) {
            return false;
        }
        count == 0 || self.unconfirmed_bytes + size <= self.options.max_unconfirmed_bytes
    }
}

/// A priority-mode queue: stored messages, attached consumers, and who holds what (see the
/// module doc for the rules).
#[derive(Debug)]
pub struct QueueCore {
    uri: String,
    limits: QueueLimits,
    /// The time arrivals count from: the first message's arrival.
    epoch: Option<Instant>,
    /// Pending (not pushed) messages, in delivery order.
    pending: VecDeque<Held>,
    /// Payload bytes held, pending and unconfirmed.
    bytes: u64,
    /// Messages pushed and not confirmed: the sum of the consumers' `unconfirmed`.
    unconfirmed: usize,
    consumers: BTreeMap<SessionAddr, Consumer>,
    /// Messages whose journal sequence is at or below this may be delivered.
    deliverable_through: u64,
    events: VecDeque<QueueEvent>,
    /// The consumers with the highest priority, sorted by key; the round-robin ring.
    active: Vec<SessionAddr>,
    /// Index in `active` of the next consumer to try.
    round_robin_next: usize,
    counters: QueueCounters,
}

impl QueueCore {
    /// An empty queue named `uri` with `limits`.
    pub fn new(uri: String, limits: QueueLimits) -> Self {
        QueueCore {
            uri,
            limits,
            epoch: None,
            pending: VecDeque::new(),
            bytes: 0,
            unconfirmed: 0,
            consumers: BTreeMap::new(),
            deliverable_through: 0,
            events: VecDeque::new(),
            active: Vec::new(),
            round_robin_next: 0,
            counters: QueueCounters::default(),
        }
    }

    /// The queue's URI.
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// The queue's limits.
    pub fn limits(&self) -> &QueueLimits {
        &self.limits
    }

    /// Why a message of `size` bytes would be refused now (`max_messages` or `max_bytes`
    /// reached), after dropping expired messages; `None` when it would be taken.
    pub fn refusal(&mut self, now: Instant, size: u64) -> Option<String> {
        self.expire(now);
        let limits = self.limits;
        if limits.max_messages > 0 && self.depth() as u64 >= limits.max_messages {
            Some(format!(
                "queue {} holds {} messages, its limit",
                self.uri, limits.max_messages
            ))
        } else if limits.max_bytes > 0 && self.bytes + size > limits.max_bytes {
            Some(format!(
                "queue {} holds {} bytes; {} more would exceed its limit of {} bytes",
                self.uri, self.bytes, size, limits.max_bytes
            ))
        } else {
            None
        }
    }

    /// Stores a message of `size` payload bytes at the tail; its record has journal sequence
    /// `journal_sequence` (it is delivered once that is deliverable). A full queue
    /// (`max_messages` or `max_bytes`, see [`QueueCore::refusal`]) refuses it with
    /// `LIMIT_REACHED`. The caller never puts a GUID the queue holds (see the module doc).
    pub fn put(
        &mut self,
        now: Instant,
        guid: u128,
        size: u32,
        journal_sequence: u64,
    ) -> PutOutcome {
        if let Some(reason) = self.refusal(now, u64::from(size)) {
            self.counters.refused += 1;
            return PutOutcome::Refused {
                status: AckStatus::LimitReached,
                reason,
            };
        }
        self.bytes += u64::from(size);
        let arrival_ns = self.arrival_ns(now);
        self.push_pending(Held::new(guid, journal_sequence, arrival_ns, size));
        self.counters.puts += 1;
        PutOutcome::Accepted
    }

    /// Stores a message rebuilt from the journal by a new primary: no limit check (it was
    /// accepted once), `failures` consumer failures so far (its next push carries attempt
    /// `failures + 1`), record at `journal_sequence`. As for [`QueueCore::put`], the caller
    /// never restores a GUID the queue holds (the journal lists each outstanding message once).
    pub fn restore(
        &mut self,
        now: Instant,
        guid: u128,
        size: u32,
        failures: u32,
        journal_sequence: u64,
    ) {
        self.bytes += u64::from(size);
        let arrival_ns = self.arrival_ns(now);
        let mut held = Held::new(guid, journal_sequence, arrival_ns, size);
        held.set_failures(failures);
        held.set_out_of_order();
        self.push_pending(held);
    }

    /// Appends to the pending deque, growing it by a quarter rather than doubling it (at most
    /// a quarter of it unused: 1,100,000 pending messages take 44-55 MiB, not 80).
    fn push_pending(&mut self, held: Held) {
        if self.pending.len() == self.pending.capacity() {
            self.pending.reserve_exact(self.pending.len() / 4 + 16);
        }
        self.pending.push_back(held);
    }

    /// `now` as an arrival: nanoseconds after the queue's epoch (set by the first call). An
    /// instant before the epoch counts as the epoch (a later arrival: never an early expiry).
    fn arrival_ns(&mut self, now: Instant) -> u64 {
        let epoch = *self.epoch.get_or_insert(now);
        u64::try_from(now.saturating_duration_since(epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    /// Messages whose record's journal sequence is at or below `sequence` may be delivered
    /// (the mark only rises).
    pub fn set_deliverable_through(&mut self, sequence: u64) {
        self.deliverable_through = self.deliverable_through.max(sequence);
    }

    /// The next event to journal and report, in order.
    pub fn poll_event(&mut self) -> Option<QueueEvent> {
        self.events.pop_front()
    }

    /// Attaches a consumer, or updates the options of one already attached (its unconfirmed
    /// messages stay with it).
    pub fn add_consumer(&mut self, key: SessionAddr, options: ConsumerOptions) {
        self.consumers
            .entry(key)
            .and_modify(|c| c.options = options)
            .or_insert_with(|| Consumer {
                options,
                unconfirmed_bytes: 0,
                unconfirmed: HashMap::default(),
            });
        self.recompute_active();
    }

    /// Detaches a consumer. Its unconfirmed messages go back to the head of the queue, in
    /// arrival order, for redelivery; with `failure` (the consumer went away or closed the
    /// queue holding them) each counts one consumer failure ([`QueueEvent::ConsumerFailed`]),
    /// and one whose failures reach `max_delivery_attempts` is removed
    /// ([`QueueEvent::Removed`]). Unknown keys are ignored.
    pub fn remove_consumer(&mut self, key: SessionAddr, failure: bool) {
        if let Some(consumer) = self.consumers.remove(&key) {
            let mut held: Vec<Held> = consumer.unconfirmed.into_values().collect();
            // In delivery order, so the failure records are journaled in a deterministic order
            // (a simulator replays a seed exactly).
            held.sort_unstable_by_key(|h| h.journal_sequence);
            let kept = if failure {
                self.count_failures(held)
            } else {
                held
            };
            self.requeue_front(kept);
            self.recompute_active();
        }
    }

    /// Detaches every consumer carried by `node` (the link to that proxy node dropped), as
    /// [`QueueCore::remove_consumer`] does for each, without counting failures: the consumers
    /// did not fail, their node's link did.
    pub fn remove_consumers_of_node(&mut self, node: NodeId) {
        let from = SessionAddr {
            origin_node: node,
            session_id: 0,
        };
        let keys: Vec<SessionAddr> = self
            .consumers
            .range(from..)
            .take_while(|(k, _)| k.origin_node == node)
            .map(|(k, _)| *k)
            .collect();
        if keys.is_empty() {
            return;
        }
        let mut released: Vec<Held> = Vec::new();
        for key in keys {
            let consumer = self.consumers.remove(&key).expect("key was just listed");
            released.extend(consumer.unconfirmed.into_values());
        }
        self.requeue_front(released);
        self.recompute_active();
    }

    /// Confirms (removes) a message pushed to `key`. Returns false, and changes nothing, when
    /// the GUID is unknown or the message is not unconfirmed by that consumer.
    pub fn confirm(&mut self, key: SessionAddr, guid: u128) -> bool {
        // A message is unconfirmed by `key` exactly when that consumer holds it.
        let Some(consumer) = self.consumers.get_mut(&key) else {
            return false;
        };
        let Some(held) = consumer.unconfirmed.remove(&guid) else {
            return false;
        };
        let size = u64::from(held.size);
        consumer.unconfirmed_bytes -= size;
        self.bytes -= size;
        self.unconfirmed -= 1;
        self.counters.confirms += 1;
        true
    }

    /// The next push to make, or `None` when nothing can be delivered now (empty queue, head
    /// not yet deliverable, no consumer, or every highest-priority consumer at capacity for the
    /// head message). Removes expired and exhausted messages it meets at the head (as events).
    /// Call until `None`.
    pub fn poll_delivery(&mut self, now: Instant) -> Option<Delivery> {
        loop {
            self.expire(now);
            let Some(held) = self.pending.front().copied() else {
                self.give_back_memory();
                return None;
            };
            if held.journal_sequence > self.deliverable_through {
                return None;
            }
            if self.exhausted(held.failures()) {
                // The limit was lowered since the last failure (a configuration change).
                self.pending.pop_front();
                self.remove(held, RemovalReason::AttemptsExhausted);
                continue;
            }
            let attempt = held.failures() + 1;
            let size = u64::from(held.size);
            let consumer_key = self.pick_consumer(size)?;
            self.pending.pop_front();
            self.give_back_memory();
            let guid = held.guid();
            let delivery = Delivery {
                consumer: consumer_key,
                guid,
                journal_sequence: held.journal_sequence,
                delivery_attempt: attempt,
                out_of_order: held.out_of_order(),
            };
            let consumer = self
                .consumers
                .get_mut(&consumer_key)
                .expect("active consumer exists");
            consumer.unconfirmed.insert(guid, held);
            consumer.unconfirmed_bytes += size;
            self.unconfirmed += 1;
            self.counters.pushes += 1;
            if attempt > 1 {
                self.counters.redeliveries += 1;
            }
            return Some(delivery);
        }
    }

    /// Drops the messages at the head of the queue that are older than the TTL at `now`;
    /// returns how many. Called by `put` and `poll_delivery`; call it on a timer to expire
    /// messages of a queue without consumers. Only pending messages expire: one held by a
    /// consumer waits for its confirm or its redelivery.
    pub fn expire(&mut self, now: Instant) -> usize {
        let Some(ttl) = self.limits.message_ttl else {
            return 0;
        };
        let mut dropped = 0;
        while let Some(held) = self.pending.front() {
            let arrival = self.epoch.expect("set by the first arrival")
                + Duration::from_nanos(held.arrival_ns);
            if now.saturating_duration_since(arrival) < ttl {
                break;
            }
            let held = self.pending.pop_front().expect("front exists");
            self.remove(held, RemovalReason::Ttl);
            dropped += 1;
        }
        if dropped > 0 {
            self.give_back_memory();
        }
        dropped
    }

    /// Shrinks the pending deque once it uses less than a quarter of its capacity (to twice
    /// its length), so a drained queue gives its memory back; amortised O(1) per message.
    fn give_back_memory(&mut self) {
        const KEEP: usize = 1024;
        let (len, capacity) = (self.pending.len(), self.pending.capacity());
        if capacity > KEEP && capacity / 4 > len {
            self.pending.shrink_to((2 * len).max(KEEP));
        }
    }

    /// Removes every message, pending or unconfirmed (an operator's purge); each is a
    /// [`QueueEvent::Removed`] with [`RemovalReason::Purged`]. Consumers stay attached; a later
    /// confirm of a purged message is ignored. Returns how many were removed.
    pub fn purge(&mut self) -> usize {
        let mut held: Vec<Held> = std::mem::take(&mut self.pending).into();
        for consumer in self.consumers.values_mut() {
            held.extend(consumer.unconfirmed.drain().map(|(_, h)| h));
            consumer.unconfirmed.shrink_to_fit();
            consumer.unconfirmed_bytes = 0;
        }
        held.sort_unstable_by_key(|h| h.journal_sequence);
        self.unconfirmed = 0;
        let removed = held.len();
        for h in held {
            self.remove(h, RemovalReason::Purged);
        }
        removed
    }

    /// Messages held: pending plus unconfirmed.
    pub fn depth(&self) -> usize {
        self.pending.len() + self.unconfirmed
    }

    /// Payload bytes held: pending plus unconfirmed.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Messages pushed and not yet confirmed.
    pub fn unconfirmed(&self) -> usize {
        self.unconfirmed
    }

    /// Messages waiting for a delivery.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// The attached consumers, in key order.
    pub fn consumer_keys(&self) -> Vec<SessionAddr> {
        self.consumers.keys().copied().collect()
    }

    /// Consumers attached.
    pub fn consumer_count(&self) -> usize {
        self.consumers.len()
    }

    /// Nothing held, no consumer, no event to report: the queue is as [`QueueCore::new`] left
    /// it but for its counters, so its owner may drop it and create it again on next use.
    pub fn is_idle(&self) -> bool {
        self.pending.is_empty()
            && self.unconfirmed == 0
            && self.consumers.is_empty()
            && self.events.is_empty()
    }

    /// The counters since creation.
    pub fn counters(&self) -> QueueCounters {
        self.counters
    }

    /// Round-robin over the highest-priority consumers, from the cursor, for one with capacity
    /// for `size` bytes; advances the cursor past it.
    fn pick_consumer(&mut self, size: u64) -> Option<SessionAddr> {
        let n = self.active.len();
        for i in 0..n {
            let index = (self.round_robin_next + i) % n;
            let key = self.active[index];
            if self.consumers[&key].has_capacity_for(size) {
                self.round_robin_next = (index + 1) % n;
                return Some(key);
            }
        }
        None
    }

    fn recompute_active(&mut self) {
        let Some(top) = self.consumers.values().map(|c| c.options.priority).max() else {
            self.active.clear();
            self.round_robin_next = 0;
            return;
        };
        self.active = self
            .consumers
            .iter()
            .filter(|(_, c)| c.options.priority == top)
            .map(|(k, _)| *k)
            .collect();
        self.round_robin_next %= self.active.len();
    }

    fn exhausted(&self, failures: u32) -> bool {
        self.limits.max_delivery_attempts > 0 && failures >= self.limits.max_delivery_attempts
    }

    /// Counts one consumer failure for each of `held` (unconfirmed by a consumer that went
    /// away); removes those that reach the limit and returns the others, still unconfirmed.
    fn count_failures(&mut self, held: Vec<Held>) -> Vec<Held> {
        let mut kept = Vec::with_capacity(held.len());
        for mut h in held {
            h.set_failures(h.failures().saturating_add(1));
            let failures = h.failures();
            self.counters.consumer_failures += 1;
            self.events.push_back(QueueEvent::ConsumerFailed {
                guid: h.guid(),
                failures,
            });
            if self.exhausted(failures) {
                self.unconfirmed -= 1;
                self.remove(h, RemovalReason::AttemptsExhausted);
            } else {
                kept.push(h);
            }
        }
        kept
    }

    /// Reports a held message, already taken out of the pending deque or its consumer's
    /// table, as removed.
    fn remove(&mut self, held: Held, reason: RemovalReason) {
        self.bytes -= u64::from(held.size);
        match reason {
            RemovalReason::Ttl => self.counters.ttl_expired += 1,
            RemovalReason::AttemptsExhausted => self.counters.attempts_exhausted += 1,
            RemovalReason::Purged => self.counters.purged += 1,
        }
        self.events.push_back(QueueEvent::Removed {
            guid: held.guid(),
            reason,
        });
    }

    /// Puts unconfirmed messages back at the head of the queue, oldest first.
    fn requeue_front(&mut self, mut held: Vec<Held>) {
        held.sort_unstable_by_key(|h| h.journal_sequence);
        for mut h in held.into_iter().rev() {
            h.set_out_of_order();
            self.unconfirmed -= 1;
            self.pending.push_front(h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_message_takes_40_bytes() {
        // The primary's memory per outstanding message (issue 17): keep it small.
        assert_eq!(std::mem::size_of::<Held>(), 40);
    }

    const UNLIMITED: QueueLimits = QueueLimits {
        max_messages: 0,
        max_bytes: 0,
        max_delivery_attempts: 0,
        message_ttl: None,
    };

    fn key(node: u32, session: u64) -> SessionAddr {
        SessionAddr {
            origin_node: NodeId(node),
            session_id: session,
        }
    }

    fn opts(priority: i32, messages: u32, bytes: u64) -> ConsumerOptions {
        ConsumerOptions {
            priority,
            max_unconfirmed_messages: messages,
            max_unconfirmed_bytes: bytes,
        }
    }

    fn guid(n: u8) -> u128 {
        u128::from(n)
    }

    /// A queue whose every message is deliverable (the partition's mark is tested apart).
    fn open(limits: QueueLimits) -> QueueCore {
        let mut q = QueueCore::new("bmq://d/q".into(), limits);
        q.set_deliverable_through(u64::MAX);
        q
    }

    /// Puts messages `ns`, each with journal sequence `n`.
    fn put_n(q: &mut QueueCore, now: Instant, ns: impl IntoIterator<Item = u8>, size: usize) {
        for n in ns {
            assert_eq!(
                q.put(now, guid(n), size as u32, u64::from(n)),
                PutOutcome::Accepted
            );
        }
    }

    fn events(q: &mut QueueCore) -> Vec<QueueEvent> {
        std::iter::from_fn(|| q.poll_event()).collect()
    }

    /// Drains every delivery as (consumer session, guid byte, attempt).
    fn drain(q: &mut QueueCore, now: Instant) -> Vec<(u64, u8, u32)> {
        let mut out = Vec::new();
        while let Some(d) = q.poll_delivery(now) {
            out.push((d.consumer.session_id, d.guid as u8, d.delivery_attempt));
        }
        out
    }

    #[test]
    fn round_robin_among_equal_priority() {
        // Three consumers of one priority receive messages in turn, in arrival order.
        let now = Instant::now();
        let mut q = open(UNLIMITED);
        for s in 1..=3 {
            q.add_consumer(key(1, s), opts(0, 100, 1 << 20));
        }
        put_n(&mut q, now, 1..=7, 10);
        assert_eq!(
            drain(&mut q, now),
            vec![
                (1, 1, 1),
                (2, 2, 1),
                (3, 3, 1),
                (1, 4, 1),
                (2, 5, 1),
                (3, 6, 1),
                (1, 7, 1)
            ]
        );
        assert_eq!(q.unconfirmed(), 7);
        assert_eq!(q.depth(), 7);
        assert_eq!(q.bytes(), 70);
        assert_eq!(q.counters().pushes, 7);
    }

    #[test]
    fn only_highest_priority_receives() {
        // A lower-priority consumer is a standby: it gets nothing while the higher one is
        // attached, even at capacity, and takes over (with redeliveries) once it leaves.
        let now = Instant::now();
        let mut q = open(UNLIMITED);
        q.add_consumer(key(1, 1), opts(0, 100, 1 << 20));
        q.add_consumer(key(1, 2), opts(5, 2, 1 << 20));
        put_n(&mut q, now, 1..=4, 10);
        assert_eq!(drain(&mut q, now), vec![(2, 1, 1), (2, 2, 1)]);
        assert_eq!(q.pending(), 2);
        q.remove_consumer(key(1, 2), true);
        assert_eq!(
            drain(&mut q, now),
            vec![(1, 1, 2), (1, 2, 2), (1, 3, 1), (1, 4, 1)]
        );
        assert_eq!(q.counters().redeliveries, 2);
    }

    #[test]
    fn priority_update_by_re_adding() {
        // Re-adding a consumer with a higher priority makes it the only receiver.
        let now = Instant::now();
        let mut q = open(UNLIMITED);
        q.add_consumer(key(1, 1), opts(0, 100, 1 << 20));
        q.add_consumer(key(1, 2), opts(0, 100, 1 << 20));
        q.add_consumer(key(1, 2), opts(1, 100, 1 << 20));
        assert_eq!(q.consumer_count(), 2);
        put_n(&mut q, now, 1..=2, 1);
        assert_eq!(drain(&mut q, now), vec![(2, 1, 1), (2, 2, 1)]);
    }

    #[test]
    fn message_capacity_and_confirm() {
        // A consumer at max_unconfirmed_messages gets nothing more until it confirms; a confirm
        // frees one slot and removes the message.
        let now = Instant::now();
        let mut q = open(UNLIMITED);
        q.add_consumer(key(1, 1), opts(0, 2, 1 << 20));
        put_n(&mut q, now, 1..=4, 10);
        assert_eq!(drain(&mut q, now), vec![(1, 1, 1), (1, 2, 1)]);
        assert!(q.confirm(key(1, 1), guid(1)));
        assert_eq!(q.depth(), 3);
        assert_eq!(q.bytes(), 30);
        assert_eq!(drain(&mut q, now), vec![(1, 3, 1)]);
        // A second confirm of the same message, another consumer's confirm, or an unknown guid
        // is refused.
        assert!(!q.confirm(key(1, 1), guid(1)));
        assert!(!q.confirm(key(1, 9), guid(2)));
        assert!(!q.confirm(key(1, 1), guid(4)));
        assert!(!q.confirm(key(1, 1), 0xdead));
        assert_eq!(q.counters().confirms, 1);
        assert!(q.confirm(key(1, 1), guid(2)));
        assert!(q.confirm(key(1, 1), guid(3)));
        assert_eq!(drain(&mut q, now), vec![(1, 4, 1)]);
        assert!(q.confirm(key(1, 1), guid(4)));
        assert_eq!((q.depth(), q.bytes(), q.unconfirmed()), (0, 0, 0));
    }

    #[test]
    fn byte_capacity() {
        // The byte limit holds back a message that would exceed it; a consumer with nothing
        // unconfirmed still takes a message larger than its limit. Round-robin skips a consumer
        // without room.
        let now = Instant::now();
        let mut q = open(UNLIMITED);
        q.add_consumer(key(1, 1), opts(0, 100, 25));
        put_n(&mut q, now, 1..=3, 10);
        assert_eq!(drain(&mut q, now), vec![(1, 1, 1), (1, 2, 1)]);
        assert!(q.confirm(key(1, 1), guid(1)));
        assert_eq!(drain(&mut q, now), vec![(1, 3, 1)]);
        assert!(q.confirm(key(1, 1), guid(2)));
        assert!(q.confirm(key(1, 1), guid(3)));
        // An oversized message flows alone.
        put_n(&mut q, now, 4..=5, 40);
        assert_eq!(drain(&mut q, now), vec![(1, 4, 1)]);
        assert!(q.confirm(key(1, 1), guid(4)));
        assert_eq!(drain(&mut q, now), vec![(1, 5, 1)]);
        assert!(q.confirm(key(1, 1), guid(5)));
        // Two consumers: the one without room is skipped.
        q.add_consumer(key(1, 2), opts(0, 100, 1000));
        put_n(&mut q, now, 6..=9, 20);
        assert_eq!(
            drain(&mut q, now),
            vec![(1, 6, 1), (2, 7, 1), (2, 8, 1), (2, 9, 1)]
        );
    }

    #[test]
    fn redelivery_after_consumer_removal() {
        // A removed consumer's unconfirmed messages go back to the head, in order, ahead of
        // newer ones, and are redelivered with attempt 2.
        let now = Instant::now();
        let mut q = open(UNLIMITED);
        q.add_consumer(key(1, 1), opts(0, 100, 1 << 20));
        q.add_consumer(key(1, 2), opts(0, 100, 1 << 20));
        put_n(&mut q, now, 1..=4, 10);
        assert_eq!(
            drain(&mut q, now),
            vec![(1, 1, 1), (2, 2, 1), (1, 3, 1), (2, 4, 1)]
        );
        put_n(&mut q, now, 5..=5, 10);
        q.remove_consumer(key(1, 1), true);
        assert_eq!(q.unconfirmed(), 2);
        assert_eq!(q.consumer_count(), 1);
        assert_eq!(drain(&mut q, now), vec![(2, 1, 2), (2, 3, 2), (2, 5, 1)]);
        // A stale confirm from the removed consumer does nothing.
        assert!(!q.confirm(key(1, 1), guid(1)));
        assert!(q.confirm(key(1, 2), guid(1)));
        assert_eq!(q.counters().redeliveries, 2);
        // With no consumer left, nothing is delivered and everything is pending.
        q.remove_consumer(key(1, 2), true);
        assert_eq!(q.poll_delivery(now), None);
        assert_eq!((q.pending(), q.unconfirmed(), q.depth()), (4, 0, 4));
    }

    #[test]
    fn remove_consumers_of_node() {
        // A proxy node's link dropping releases exactly its consumers' messages, redelivered
        // with the same attempt: the consumers did not fail.
        let now = Instant::now();
        let mut q = open(UNLIMITED);
        q.add_consumer(key(1, 7), opts(0, 100, 1 << 20));
        q.add_consumer(key(2, 1), opts(0, 100, 1 << 20));
        q.add_consumer(key(2, 2), opts(0, 100, 1 << 20));
        q.add_consumer(key(3, 1), opts(0, 100, 1 << 20));
        put_n(&mut q, now, 1..=4, 1);
        let first: Vec<_> = std::iter::from_fn(|| q.poll_delivery(now))
            .map(|d| (d.consumer, d.guid as u8))
            .collect();
        assert_eq!(
            first,
            vec![
                (key(1, 7), 1),
                (key(2, 1), 2),
                (key(2, 2), 3),
                (key(3, 1), 4)
            ]
        );
        q.remove_consumers_of_node(NodeId(2));
        assert_eq!(q.consumer_count(), 2);
        let again: Vec<_> = std::iter::from_fn(|| q.poll_delivery(now))
            .map(|d| (d.consumer, d.guid as u8, d.delivery_attempt))
            .collect();
        assert_eq!(again, vec![(key(1, 7), 2, 1), (key(3, 1), 3, 1)]);
        assert_eq!(q.counters().consumer_failures, 0);
        q.remove_consumers_of_node(NodeId(9));
        assert_eq!(q.consumer_count(), 2);
    }

    #[test]
    fn max_delivery_attempts_drops_poison_messages() {
        // With max 2 attempts, a message whose consumers die twice is dropped, not delivered a
        // third time.
        let now = Instant::now();
        let limits = QueueLimits {
            max_delivery_attempts: 2,
            ..UNLIMITED
        };
        let mut q = open(limits);
        put_n(&mut q, now, 1..=2, 10);
        q.add_consumer(key(1, 1), opts(0, 1, 1 << 20));
        assert_eq!(drain(&mut q, now), vec![(1, 1, 1)]);
        q.remove_consumer(key(1, 1), true);
        q.add_consumer(key(1, 2), opts(0, 1, 1 << 20));
        assert_eq!(drain(&mut q, now), vec![(2, 1, 2)]);
        q.remove_consumer(key(1, 2), true);
        q.add_consumer(key(1, 3), opts(0, 1, 1 << 20));
        assert_eq!(drain(&mut q, now), vec![(3, 2, 1)]);
        assert_eq!(q.counters().attempts_exhausted, 1);
        assert_eq!((q.depth(), q.bytes()), (1, 10));
    }

    #[test]
    fn ttl_drops_old_pending_messages() {
        // Messages older than the TTL at the head are dropped, not delivered; younger ones are.
        let t0 = Instant::now();
        let limits = QueueLimits {
            message_ttl: Some(Duration::from_secs(10)),
            ..UNLIMITED
        };
        let mut q = open(limits);
        put_n(&mut q, t0, 1..=2, 10);
        put_n(&mut q, t0 + Duration::from_secs(5), 3..=3, 10);
        let t = t0 + Duration::from_secs(10);
        assert_eq!(q.expire(t), 2);
        assert_eq!((q.depth(), q.bytes()), (1, 10));
        q.add_consumer(key(1, 1), opts(0, 100, 1 << 20));
        assert_eq!(drain(&mut q, t), vec![(1, 3, 1)]);
        // An unconfirmed message does not expire while held; it expires once released.
        let later = t0 + Duration::from_secs(100);
        assert_eq!(q.expire(later), 0);
        q.remove_consumer(key(1, 1), true);
        q.add_consumer(key(1, 2), opts(0, 100, 1 << 20));
        assert_eq!(drain(&mut q, later), vec![]);
        assert_eq!(q.counters().ttl_expired, 3);
        assert_eq!(q.depth(), 0);
    }

    #[test]
    fn a_drained_queue_gives_its_memory_back() {
        // 100,000 pending messages delivered and confirmed leave the pending deque small again
        // (issue 17: memory follows what is outstanding, not what passed).
        let now = Instant::now();
        let mut q = open(UNLIMITED);
        for n in 1..=100_000u64 {
            assert_eq!(q.put(now, u128::from(n), 1, n), PutOutcome::Accepted);
        }
        assert!(q.pending.capacity() >= 100_000);
        q.add_consumer(key(1, 1), opts(0, 10, 1 << 20));
        loop {
            let ds: Vec<Delivery> = std::iter::from_fn(|| q.poll_delivery(now)).collect();
            if ds.is_empty() {
                break;
            }
            for d in ds {
                assert!(q.confirm(d.consumer, d.guid));
            }
        }
        assert_eq!((q.depth(), q.bytes(), q.unconfirmed()), (0, 0, 0));
        assert!(
            q.pending.capacity() <= 2048,
            "capacity {} after the drain",
            q.pending.capacity()
        );
        assert_eq!(q.counters().confirms, 100_000);
    }

    #[test]
    fn depth_limits_refuse_puts() {
        // A full queue, by messages or by bytes, refuses with LIMIT_REACHED; a confirm makes
        // room again.
        let now = Instant::now();
        let limits = QueueLimits {
            max_messages: 2,
            max_bytes: 25,
            ..UNLIMITED
        };
        let mut q = open(limits);
        put_n(&mut q, now, 1..=2, 10);
        let refused = q.put(now, guid(3), 1, 3);
        assert!(
            matches!(&refused, PutOutcome::Refused { status: AckStatus::LimitReached, reason } if reason.contains("2 messages")),
            "{refused:?}"
        );
        q.add_consumer(key(1, 1), opts(0, 100, 1 << 20));
        drain(&mut q, now);
        assert!(q.confirm(key(1, 1), guid(1)));
        // One slot free, but 10 + 16 bytes exceed 25.
        let refused = q.put(now, guid(3), 16, 3);
        assert!(
            matches!(&refused, PutOutcome::Refused { status: AckStatus::LimitReached, reason } if reason.contains("25 bytes")),
            "{refused:?}"
        );
        assert_eq!(q.put(now, guid(3), 15, 3), PutOutcome::Accepted);
        assert_eq!(q.counters().refused, 2);
        assert_eq!((q.depth(), q.bytes()), (2, 25));
    }

    #[test]
    fn a_delivery_names_the_journal_record() {
        // A delivery names the message's GUID and journal record (the partition reads the
        // payload and properties from there).
        let now = Instant::now();
        let mut q = open(UNLIMITED);
        q.put(now, guid(1), 4, 17);
        q.add_consumer(key(4, 2), opts(0, 1, 1));
        let d = q.poll_delivery(now).unwrap();
        assert_eq!(
            d,
            Delivery {
                consumer: key(4, 2),
                guid: guid(1),
                journal_sequence: 17,
                delivery_attempt: 1,
                out_of_order: false,
            }
        );
    }

    #[test]
    fn nothing_is_delivered_beyond_the_deliverable_mark() {
        // Messages wait until their journal sequence is deliverable (a quorum holds them), then
        // go out in order.
        let now = Instant::now();
        let mut q = QueueCore::new("bmq://d/q".into(), UNLIMITED);
        q.add_consumer(key(1, 1), opts(0, 100, 1 << 20));
        put_n(&mut q, now, 1..=3, 10);
        assert_eq!(drain(&mut q, now), vec![]);
        q.set_deliverable_through(2);
        assert_eq!(drain(&mut q, now), vec![(1, 1, 1), (1, 2, 1)]);
        q.set_deliverable_through(1);
        assert_eq!(drain(&mut q, now), vec![], "the mark never goes down");
        q.set_deliverable_through(3);
        assert_eq!(drain(&mut q, now), vec![(1, 3, 1)]);
    }

    #[test]
    fn only_consumer_failures_raise_the_attempt() {
        // A consumer that goes away holding a message is a failure (attempt 2, an event); a
        // consumer released because its node's link dropped or its node stops is not.
        let now = Instant::now();
        let mut q = open(UNLIMITED);
        put_n(&mut q, now, 1..=1, 10);
        q.add_consumer(key(1, 1), opts(0, 1, 1 << 20));
        assert_eq!(drain(&mut q, now), vec![(1, 1, 1)]);
        q.remove_consumer(key(1, 1), false);
        q.add_consumer(key(2, 1), opts(0, 1, 1 << 20));
        assert_eq!(drain(&mut q, now), vec![(1, 1, 1)]);
        q.remove_consumers_of_node(NodeId(2));
        q.add_consumer(key(1, 2), opts(0, 1, 1 << 20));
        assert_eq!(drain(&mut q, now), vec![(2, 1, 1)]);
        assert_eq!(events(&mut q), vec![]);
        q.remove_consumer(key(1, 2), true);
        assert_eq!(
            events(&mut q),
            vec![QueueEvent::ConsumerFailed {
                guid: guid(1),
                failures: 1
            }]
        );
        q.add_consumer(key(1, 3), opts(0, 1, 1 << 20));
        assert_eq!(drain(&mut q, now), vec![(3, 1, 2)]);
        assert_eq!(q.counters().consumer_failures, 1);
    }

    #[test]
    fn removals_without_confirm_are_events() {
        // Exhausted attempts, an expired TTL and a purge each report the message removed.
        let now = Instant::now();
        let limits = QueueLimits {
            max_delivery_attempts: 1,
            message_ttl: Some(Duration::from_secs(10)),
            ..UNLIMITED
        };
        let mut q = open(limits);
        put_n(&mut q, now, 1..=1, 10);
        q.add_consumer(key(1, 1), opts(0, 1, 1 << 20));
        assert_eq!(drain(&mut q, now), vec![(1, 1, 1)]);
        q.remove_consumer(key(1, 1), true);
        assert_eq!(
            events(&mut q),
            vec![
                QueueEvent::ConsumerFailed {
                    guid: guid(1),
                    failures: 1
                },
                QueueEvent::Removed {
                    guid: guid(1),
                    reason: RemovalReason::AttemptsExhausted
                },
            ]
        );
        assert_eq!((q.depth(), q.unconfirmed(), q.bytes()), (0, 0, 0));
        put_n(&mut q, now, 2..=2, 10);
        assert_eq!(q.expire(now + Duration::from_secs(10)), 1);
        assert_eq!(
            events(&mut q),
            vec![QueueEvent::Removed {
                guid: guid(2),
                reason: RemovalReason::Ttl
            }]
        );
        put_n(&mut q, now, 3..=4, 10);
        q.add_consumer(key(1, 2), opts(0, 1, 1 << 20));
        assert_eq!(drain(&mut q, now), vec![(2, 3, 1)]);
        assert_eq!(q.purge(), 2);
        let removed: Vec<QueueEvent> = events(&mut q);
        assert_eq!(
            removed,
            vec![
                QueueEvent::Removed {
                    guid: guid(3),
                    reason: RemovalReason::Purged
                },
                QueueEvent::Removed {
                    guid: guid(4),
                    reason: RemovalReason::Purged
                },
            ]
        );
        assert!(
            !q.confirm(key(1, 2), guid(3)),
            "a purged message cannot be confirmed"
        );
        assert_eq!((q.depth(), q.unconfirmed(), q.bytes()), (0, 0, 0));
    }

    #[test]
    fn released_and_restored_messages_are_out_of_order() {
        // A message released by a consumer (for any reason) or restored by a new primary may
        // have been delivered before: its push says so; a first delivery does not.
        let now = Instant::now();
        let mut q = open(UNLIMITED);
        put_n(&mut q, now, 1..=2, 10);
        q.restore(now, guid(3), 1, 0, 3);
        q.add_consumer(key(1, 1), opts(0, 1, 1 << 20));
        let first = q.poll_delivery(now).unwrap();
        assert!(!first.out_of_order);
        q.remove_consumers_of_node(NodeId(1));
        q.add_consumer(key(2, 1), opts(0, 3, 1 << 20));
        let flags: Vec<(u8, bool)> = std::iter::from_fn(|| q.poll_delivery(now))
            .map(|d| (d.guid as u8, d.out_of_order))
            .collect();
        assert_eq!(flags, vec![(1, true), (2, false), (3, true)]);
    }
}
