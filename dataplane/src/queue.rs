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

use std::sync::Arc;

use bmq_proto::client::{AckStatus, Property};
use bmq_proto::expression::Expression;
use bmq_proto::{NodeId, SessionAddr};

/// A consumer's priority and flow control, as resolved by the primary (no "0 = default" here:
/// the caller replaces zeros by the broker's defaults before calling the core).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConsumerOptions {
    /// Higher receives first; only the highest priority present receives at all.
    pub priority: i32,
    /// Most messages pushed to this consumer and not yet confirmed. 0 means it receives nothing
    /// and takes no part in the choice of consumers (a suspended consumer, BlazingMQ's
    /// "deconfigured" reader): it is no standby that keeps lower priorities from receiving.
    pub max_unconfirmed_messages: u32,
    /// Most payload bytes pushed to this consumer and not yet confirmed (a lone message larger
    /// than this is still delivered when nothing else is unconfirmed).
    pub max_unconfirmed_bytes: u64,
    /// The consumer's subscription its deliveries are made under, echoed in each
    /// [`Delivery`] (the client routes a push by it).
    pub subscription_id: u32,
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
    /// The consumer's subscription it goes to ([`ConsumerOptions::subscription_id`]).
    pub subscription_id: u32,
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
    /// Its app was removed from the queue's fanout domain: the partition drops the app's
    /// copies with its queue core (never a [`QueueEvent`]: the journal's `StoredQueueApps`
    /// removes them all at once).
    AppRemoved,
}

impl RemovalReason {
    /// `ttl`, `attempts_exhausted`, `purged` or `app_removed` (metric label, log field,
    /// journal value).
    pub fn as_str(self) -> &'static str {
        match self {
            RemovalReason::Ttl => "ttl",
            RemovalReason::AttemptsExhausted => "attempts_exhausted",
            RemovalReason::Purged => "purged",
            RemovalReason::AppRemoved => "app_removed",
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
/// outstanding messages. A pending message is one entry of the pending deque; a
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

/// One subscription of a consumer: its priority, flow control and expression, and what it
/// holds unconfirmed.
#[derive(Debug)]
struct Sub {
    options: ConsumerOptions,
    /// `None`: every message.
    expression: Option<Arc<Expression>>,
    unconfirmed: u64,
    unconfirmed_bytes: u64,
}

impl Sub {
    fn has_capacity_for(&self, size: u64) -> bool {
        if self.unconfirmed >= u64::from(self.options.max_unconfirmed_messages) {
            return false;
        }
        self.unconfirmed == 0 || self.unconfirmed_bytes + size <= self.options.max_unconfirmed_bytes
    }
}

/// A message pushed to a consumer and not yet confirmed, with the subscription it went to.
#[derive(Debug, Clone, Copy)]
struct Taken {
    held: Held,
    subscription_id: u32,
}

#[derive(Debug)]
struct Consumer {
    /// Its subscriptions (most consumers have one); none: it receives nothing.
    subs: Vec<Sub>,
    /// The messages pushed to this consumer and not yet confirmed, by GUID (hashed with
    /// foldhash's keyed `quality::RandomState`, as the GUID index: one insert and one remove per
    /// message, where std's SipHash showed in the profile of the primary's partition thread).
    unconfirmed: HashMap<u128, Taken, RandomState>,
}

/// A subscription of a consumer: the consumer's key and the subscription's index.
type Unit = (SessionAddr, usize);

/// A unit that can receive, for the choice of consumers with expressions: its priority and
/// the index of its expression in [`QueueCore::groups`] (`None`: every message).
#[derive(Debug, Clone, Copy)]
struct Candidate {
    unit: Unit,
    priority: i32,
    group: Option<usize>,
}

/// Most distinct subscription expressions on one queue (a bit each in a message's match
/// mask).
pub const EXPRESSIONS_PER_QUEUE_MAX: usize = 64;

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
    /// Without expressions: the subscriptions with the highest priority, sorted by key; the
    /// round-robin ring.
    active: Vec<Unit>,
    /// Index in `active` (or, with expressions, in the candidates of a message) of the next
    /// subscription to try.
    round_robin_next: usize,
    /// With expressions: every subscription that can receive.
    candidates: Vec<Candidate>,
    /// The distinct expressions of the subscriptions, by text; a message's match mask has bit
    /// `i` when it matches `groups[i]`.
    groups: Vec<Arc<Expression>>,
    /// Match masks of pending messages, by journal sequence (cleared when `groups` changes).
    masks: HashMap<u64, u64, RandomState>,
    /// With expressions: pending messages before this index were found undeliverable since
    /// the last change that could make one deliverable (capacity freed, consumers changed), so
    /// a scan starts here.
    scan_from: usize,
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
            candidates: Vec::new(),
            groups: Vec::new(),
            masks: HashMap::default(),
            scan_from: 0,
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

    /// Replaces the queue's limits (its domain changed): a lower depth limit refuses the next
    /// PUT, a TTL or a delivery-attempt limit applies to the messages held from the next
    /// delivery or sweep on.
    pub fn set_limits(&mut self, limits: QueueLimits) {
        self.limits = limits;
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

    /// Attaches a consumer with one subscription of every message, or updates the options of
    /// one already attached (its unconfirmed messages stay with it).
    pub fn add_consumer(&mut self, key: SessionAddr, options: ConsumerOptions) {
        let added = self.set_subscriptions(key, vec![(options, None)]);
        // No expression of its own: it cannot pass the limit the others stay within.
        debug_assert!(added.is_ok(), "{added:?}");
    }

    /// Whether `subscriptions` for `key` keep the queue within [`EXPRESSIONS_PER_QUEUE_MAX`]
    /// distinct expressions (see [`QueueCore::set_subscriptions`]).
    pub fn subscriptions_fit(
        &self,
        key: SessionAddr,
        subscriptions: &[(ConsumerOptions, Option<Arc<Expression>>)],
    ) -> Result<(), String> {
        let mut texts: Vec<&str> = self
            .consumers
            .iter()
            .filter(|(k, _)| **k != key)
            .flat_map(|(_, c)| c.subs.iter().filter_map(|s| s.expression.as_deref()))
            .chain(subscriptions.iter().filter_map(|(_, e)| e.as_deref()))
            .map(Expression::text)
            .collect();
        texts.sort_unstable();
        texts.dedup();
        if texts.len() > EXPRESSIONS_PER_QUEUE_MAX {
            return Err(format!(
                "queue {} would have {} distinct subscription expressions; the limit is \
                 {EXPRESSIONS_PER_QUEUE_MAX}",
                self.uri,
                texts.len()
            ));
        }
        Ok(())
    }

    /// Attaches a consumer with `subscriptions` (its options, and its expression: `None` for
    /// every message), or replaces those of one already attached: its unconfirmed messages
    /// stay with it, counted against the subscription they went to while it keeps its id.
    /// No subscription: the consumer stays attached and receives nothing.
    ///
    /// Errors: more than [`EXPRESSIONS_PER_QUEUE_MAX`] distinct expressions on the queue;
    /// nothing is changed.
    pub fn set_subscriptions(
        &mut self,
        key: SessionAddr,
        subscriptions: Vec<(ConsumerOptions, Option<Arc<Expression>>)>,
    ) -> Result<(), String> {
        self.subscriptions_fit(key, &subscriptions)?;
        let consumer = self.consumers.entry(key).or_insert_with(|| Consumer {
            subs: Vec::new(),
            unconfirmed: HashMap::default(),
        });
        let mut subs: Vec<Sub> = subscriptions
            .into_iter()
            .map(|(options, expression)| Sub {
                options,
                expression,
                unconfirmed: 0,
                unconfirmed_bytes: 0,
            })
            .collect();
        for taken in consumer.unconfirmed.values() {
            if let Some(sub) = subs
                .iter_mut()
                .find(|s| s.options.subscription_id == taken.subscription_id)
            {
                sub.unconfirmed += 1;
                sub.unconfirmed_bytes += u64::from(taken.held.size);
            }
        }
        consumer.subs = subs;
        self.recompute_active();
        Ok(())
    }

    /// Detaches a consumer. Its unconfirmed messages go back to the head of the queue, in
    /// arrival order, for redelivery; with `failure` (the consumer went away or closed the
    /// queue holding them) each counts one consumer failure ([`QueueEvent::ConsumerFailed`]),
    /// and one whose failures reach `max_delivery_attempts` is removed
    /// ([`QueueEvent::Removed`]). Unknown keys are ignored.
    pub fn remove_consumer(&mut self, key: SessionAddr, failure: bool) {
        if let Some(consumer) = self.consumers.remove(&key) {
            let mut held: Vec<Held> = consumer.unconfirmed.into_values().map(|t| t.held).collect();
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
            released.extend(consumer.unconfirmed.into_values().map(|t| t.held));
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
        let Some(taken) = consumer.unconfirmed.remove(&guid) else {
            return false;
        };
        let size = u64::from(taken.held.size);
        if let Some(sub) = consumer
            .subs
            .iter_mut()
            .find(|s| s.options.subscription_id == taken.subscription_id)
        {
            sub.unconfirmed -= 1;
            sub.unconfirmed_bytes -= size;
        }
        self.bytes -= size;
        self.unconfirmed -= 1;
        self.counters.confirms += 1;
        // Capacity came back: a message skipped for want of it may go now.
        self.scan_from = 0;
        true
    }

    /// The next push to make, or `None` when nothing can be delivered now (empty queue, head
    /// not yet deliverable, no consumer, or every highest-priority consumer at capacity for the
    /// head message). Removes expired and exhausted messages it meets at the head (as events).
    /// Call until `None`. With subscription expressions, see [`QueueCore::poll_delivery_with`]:
    /// here a message's properties are unknown, so it matches no expression.
    pub fn poll_delivery(&mut self, now: Instant) -> Option<Delivery> {
        self.poll_delivery_with(now, &mut |_| None)
    }

    /// [`QueueCore::poll_delivery`], reading a message's properties (by the journal sequence of
    /// its record) through `properties` when a subscription has an expression. Then a message
    /// goes to the highest-priority subscriptions whose expression it matches (round-robin
    /// among those with capacity); one that matches none, or whose subscriptions are all at
    /// capacity, stays pending — in its place — and the messages behind it go on
    /// (BlazingMQ's subscriptions). A message's matches are evaluated once and kept while the
    /// expressions stay the same.
    pub fn poll_delivery_with(
        &mut self,
        now: Instant,
        properties: &mut dyn FnMut(u64) -> Option<Vec<Property>>,
    ) -> Option<Delivery> {
        if !self.groups.is_empty() {
            return self.poll_by_subscription(now, properties);
        }
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
            let unit = self.pick_unit(u64::from(held.size))?;
            self.pending.pop_front();
            self.give_back_memory();
            return Some(self.hand_over(unit, held));
        }
    }

    /// Records the delivery of `held` to `unit` and describes it.
    fn hand_over(&mut self, unit: Unit, held: Held) -> Delivery {
        let (key, index) = unit;
        let attempt = held.failures() + 1;
        let size = u64::from(held.size);
        let guid = held.guid();
        let consumer = self
            .consumers
            .get_mut(&key)
            .expect("active consumer exists");
        let sub = &mut consumer.subs[index];
        sub.unconfirmed += 1;
        sub.unconfirmed_bytes += size;
        let subscription_id = sub.options.subscription_id;
        consumer.unconfirmed.insert(
            guid,
            Taken {
                held,
                subscription_id,
            },
        );
        self.masks.remove(&held.journal_sequence);
        self.unconfirmed += 1;
        self.counters.pushes += 1;
        if attempt > 1 {
            self.counters.redeliveries += 1;
        }
        Delivery {
            consumer: key,
            subscription_id,
            guid,
            journal_sequence: held.journal_sequence,
            delivery_attempt: attempt,
            out_of_order: held.out_of_order(),
        }
    }

    /// The delivery rule with subscription expressions (see
    /// [`QueueCore::poll_delivery_with`]): scans the pending messages from
    /// [`QueueCore::scan_from`].
    fn poll_by_subscription(
        &mut self,
        now: Instant,
        properties: &mut dyn FnMut(u64) -> Option<Vec<Property>>,
    ) -> Option<Delivery> {
        self.expire(now);
        let mut i = self.scan_from;
        while i < self.pending.len() {
            let held = self.pending[i];
            if held.journal_sequence > self.deliverable_through {
                // Arrival order is journal order: nothing further is deliverable either.
                break;
            }
            if self.exhausted(held.failures()) {
                self.pending.remove(i);
                self.masks.remove(&held.journal_sequence);
                self.remove(held, RemovalReason::AttemptsExhausted);
                continue;
            }
            let mask = match self.masks.get(&held.journal_sequence) {
                Some(mask) => *mask,
                None => {
                    let props = properties(held.journal_sequence).unwrap_or_default();
                    let mask = self
                        .groups
                        .iter()
                        .enumerate()
                        .filter(|(_, e)| e.matches(&props[..]))
                        .fold(0u64, |m, (g, _)| m | 1 << g);
                    self.masks.insert(held.journal_sequence, mask);
                    mask
                }
            };
            if let Some(unit) = self.pick_matching(mask, u64::from(held.size)) {
                self.pending.remove(i);
                self.scan_from = i;
                self.give_back_memory();
                return Some(self.hand_over(unit, held));
            }
            i += 1;
        }
        self.scan_from = i;
        if self.pending.is_empty() {
            self.give_back_memory();
        }
        None
    }

    /// Among the subscriptions whose expression matches `mask`, the highest priority ones,
    /// round-robin: one with capacity for `size` bytes.
    fn pick_matching(&mut self, mask: u64, size: u64) -> Option<Unit> {
        let matching = |c: &Candidate| c.group.is_none_or(|g| mask & (1 << g) != 0);
        let top = self
            .candidates
            .iter()
            .filter(|c| matching(c))
            .map(|c| c.priority)
            .max()?;
        let n = self.candidates.len();
        for step in 0..n {
            let c = self.candidates[(self.round_robin_next + step) % n];
            if c.priority != top || !matching(&c) {
                continue;
            }
            let (key, index) = c.unit;
            if self.consumers[&key].subs[index].has_capacity_for(size) {
                self.round_robin_next = (self.round_robin_next + step + 1) % n;
                return Some(c.unit);
            }
        }
        None
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
            self.masks.remove(&held.journal_sequence);
            self.scan_from = self.scan_from.saturating_sub(1);
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
            held.extend(consumer.unconfirmed.drain().map(|(_, t)| t.held));
            consumer.unconfirmed.shrink_to_fit();
            for sub in &mut consumer.subs {
                sub.unconfirmed = 0;
                sub.unconfirmed_bytes = 0;
            }
        }
        self.masks.clear();
        self.scan_from = 0;
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

    /// Round-robin over the highest-priority subscriptions, from the cursor, for one with
    /// capacity for `size` bytes; advances the cursor past it.
    fn pick_unit(&mut self, size: u64) -> Option<Unit> {
        let n = self.active.len();
        for i in 0..n {
            let index = (self.round_robin_next + i) % n;
            let (key, sub) = self.active[index];
            if self.consumers[&key].subs[sub].has_capacity_for(size) {
                self.round_robin_next = (index + 1) % n;
                return Some((key, sub));
            }
        }
        None
    }

    /// After a change of consumers or subscriptions: the ring of highest-priority
    /// subscriptions, or (with expressions) the candidates and their expressions.
    fn recompute_active(&mut self) {
        // A suspended subscription (no capacity at all) is not a candidate.
        let units: Vec<(Unit, &Sub)> = self
            .consumers
            .iter()
            .flat_map(|(k, c)| c.subs.iter().enumerate().map(move |(i, s)| ((*k, i), s)))
            .filter(|(_, s)| s.options.max_unconfirmed_messages > 0)
            .collect();
        self.scan_from = 0;
        let mut texts: Vec<Arc<Expression>> = units
            .iter()
            .filter_map(|(_, s)| s.expression.clone())
            .collect();
        texts.sort_unstable_by(|a, b| a.text().cmp(b.text()));
        texts.dedup_by(|a, b| a.text() == b.text());
        let same = texts.len() == self.groups.len()
            && texts
                .iter()
                .zip(&self.groups)
                .all(|(a, b)| a.text() == b.text());
        if !same {
            self.masks.clear();
        }
        self.groups = texts;
        if !self.groups.is_empty() {
            let groups = &self.groups;
            self.candidates = units
                .iter()
                .map(|(unit, s)| Candidate {
                    unit: *unit,
                    priority: s.options.priority,
                    group: s
                        .expression
                        .as_ref()
                        .and_then(|e| groups.iter().position(|g| g.text() == e.text())),
                })
                .collect();
            self.active.clear();
            self.round_robin_next %= self.candidates.len().max(1);
            return;
        }
        self.candidates.clear();
        let Some(top) = units.iter().map(|(_, s)| s.options.priority).max() else {
            self.active.clear();
            self.round_robin_next = 0;
            return;
        };
        self.active = units
            .iter()
            .filter(|(_, s)| s.options.priority == top)
            .map(|(u, _)| *u)
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
            // An app's removal never comes here (the partition drops its core whole).
            RemovalReason::Purged | RemovalReason::AppRemoved => self.counters.purged += 1,
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
        // The primary's memory per outstanding message: keep it small, since a primary may hold
        // millions.
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
            subscription_id: 0,
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
        // (memory follows what is outstanding, not what passed).
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
                subscription_id: 0,
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

    /// Properties `seq = n` for the message of journal sequence `n` (a stand-in for the
    /// journal the partition reads them from).
    fn seq_props(sequence: u64) -> Option<Vec<Property>> {
        Some(vec![Property {
            key: "seq".into(),
            value: sequence.to_string(),
            value_type: bmq_proto::client::PropertyType::Int64 as i32,
        }])
    }

    fn sub(
        priority: i32,
        messages: u32,
        id: u32,
        expression: &str,
    ) -> (ConsumerOptions, Option<Arc<Expression>>) {
        let mut o = opts(priority, messages, 1 << 20);
        o.subscription_id = id;
        let e =
            (!expression.is_empty()).then(|| Arc::new(Expression::compile(expression).unwrap()));
        (o, e)
    }

    fn deliveries(q: &mut QueueCore, now: Instant) -> Vec<(u8, u32)> {
        std::iter::from_fn(|| q.poll_delivery_with(now, &mut seq_props))
            .map(|d| (d.guid as u8, d.subscription_id))
            .collect()
    }

    #[test]
    fn a_message_goes_to_the_highest_priority_subscription_it_matches() {
        // BlazingMQ's subscriptions: each message to the highest-priority subscriptions whose
        // expression it matches, round-robin among them; a push names its subscription.
        let now = Instant::now();
        let mut q = open(UNLIMITED);
        for n in 1..=6u8 {
            q.put(now, guid(n), 10, u64::from(n));
        }
        q.set_deliverable_through(6);
        // Consumer 1: seq > 3 at priority 5; consumer 2: every message at priority 1.
        q.set_subscriptions(key(1, 1), vec![sub(5, 10, 11, "seq > 3")])
            .unwrap();
        q.set_subscriptions(key(1, 2), vec![sub(1, 10, 21, "")])
            .unwrap();
        let got = deliveries(&mut q, now);
        assert_eq!(
            got,
            vec![(1, 21), (2, 21), (3, 21), (4, 11), (5, 11), (6, 11)]
        );
        assert_eq!(q.unconfirmed(), 6);
    }

    #[test]
    fn messages_that_match_no_subscription_wait_for_one() {
        // A message no subscription matches stays pending, in its place, while those behind it
        // go on; a later subscription that matches takes it.
        let now = Instant::now();
        let mut q = open(UNLIMITED);
        for n in 1..=4u8 {
            q.put(now, guid(n), 10, u64::from(n));
        }
        q.set_deliverable_through(4);
        q.set_subscriptions(key(1, 1), vec![sub(0, 10, 7, "seq % 2 == 0")])
            .unwrap();
        assert_eq!(deliveries(&mut q, now), vec![(2, 7), (4, 7)]);
        assert_eq!(q.pending(), 2, "the odd ones wait");
        // A second subscription of the same consumer takes them.
        q.set_subscriptions(
            key(1, 1),
            vec![sub(0, 10, 7, "seq % 2 == 0"), sub(0, 10, 8, "seq % 2 == 1")],
        )
        .unwrap();
        assert_eq!(deliveries(&mut q, now), vec![(1, 8), (3, 8)]);
        // The even ones stayed counted against subscription 7: its confirms free it.
        assert!(q.confirm(key(1, 1), guid(2)));
        assert_eq!(q.unconfirmed(), 3);
    }

    #[test]
    fn a_full_subscription_holds_its_messages_not_others() {
        // Each subscription has its own limit; a message whose matching subscriptions are all
        // at capacity waits, and messages for other subscriptions pass it.
        let now = Instant::now();
        let mut q = open(UNLIMITED);
        for n in 1..=6u8 {
            q.put(now, guid(n), 10, u64::from(n));
        }
        q.set_deliverable_through(6);
        q.set_subscriptions(
            key(1, 1),
            vec![sub(0, 1, 1, "seq <= 3"), sub(0, 10, 2, "seq > 3")],
        )
        .unwrap();
        assert_eq!(
            deliveries(&mut q, now),
            vec![(1, 1), (4, 2), (5, 2), (6, 2)]
        );
        assert!(q.confirm(key(1, 1), guid(1)));
        assert_eq!(deliveries(&mut q, now), vec![(2, 1)]);
        // A suspended consumer keeps what it holds and receives nothing.
        q.set_subscriptions(key(1, 1), Vec::new()).unwrap();
        assert!(q.confirm(key(1, 1), guid(2)));
        assert!(deliveries(&mut q, now).is_empty());
        assert_eq!(q.pending(), 1);
    }

    #[test]
    fn a_reader_that_leaves_gives_back_what_matched_it() {
        // Unconfirmed messages of a consumer that leaves go back to the queue and to the next
        // subscription that matches them; new puts are checked as they come.
        let now = Instant::now();
        let mut q = open(UNLIMITED);
        q.set_subscriptions(key(1, 1), vec![sub(0, 10, 1, "seq >= 2")])
            .unwrap();
        for n in 1..=3u8 {
            q.put(now, guid(n), 10, u64::from(n));
            q.set_deliverable_through(u64::from(n));
        }
        assert_eq!(deliveries(&mut q, now), vec![(2, 1), (3, 1)]);
        q.remove_consumer(key(1, 1), false);
        q.set_subscriptions(key(1, 2), vec![sub(0, 10, 9, "seq != 2")])
            .unwrap();
        q.put(now, guid(4), 10, 4);
        q.set_deliverable_through(4);
        // Given-back messages go first, as in every mode (redeliveries, out of order).
        assert_eq!(deliveries(&mut q, now), vec![(3, 9), (1, 9), (4, 9)]);
        assert_eq!(
            q.pending(),
            1,
            "message 2 waits for a subscription that takes it"
        );
    }

    #[test]
    fn too_many_distinct_expressions_are_refused_and_change_nothing() {
        let now = Instant::now();
        let mut q = open(UNLIMITED);
        let many: Vec<_> = (0..=EXPRESSIONS_PER_QUEUE_MAX as u32)
            .map(|i| sub(0, 1, i, &format!("seq == {i}")))
            .collect();
        let err = q.set_subscriptions(key(1, 1), many).unwrap_err();
        assert!(err.contains("limit is 64"), "{err}");
        assert_eq!(q.consumer_count(), 0);
        q.put(now, guid(1), 10, 1);
        q.set_deliverable_through(1);
        assert!(q.poll_delivery(now).is_none());
    }
}
