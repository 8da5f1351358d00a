//! Benchmark clients on threads of their own (docs/bench/JOURNAL.md, "A thread per benchmark
//! client"): `bmqctl bench messages` (and scripts/peer-probe, for every system it compares) runs
//! each producer and consumer under a current-thread tokio runtime on its own OS thread. A
//! client's background connection task, its PUTs or deliveries and its ACK collector then wake
//! each other without crossing threads, while the clients still run in parallel; under one
//! multi-thread runtime the same loop made 10% fewer messages per second with 256 in flight on a
//! 2-vCPU host, as the runtime's workers handed each batch back and forth.
//!
//! The shape of a run: start every client with [`on_own_thread`] and wait for each with
//! [`client_ready`] (consumers first), send the run's start on a `watch` channel that every
//! client awaits with [`wait_for_start`], then collect each thread's result with [`finished`].
//! Dropping the `watch` sender instead (an error elsewhere) tells the waiting clients to
//! disconnect and end.

use std::future::Future;
use std::time::Instant;

use anyhow::{bail, Context};
use tokio::sync::{oneshot, watch};

/// A bench client's thread, as `on_own_thread` started it: its result once it ends (closed
/// without one if it panicked).
pub type ClientThread<T> = oneshot::Receiver<anyhow::Result<T>>;

/// Runs one bench client on a thread of its own, named `name`, under a current-thread tokio
/// runtime, so that its connection task, its PUTs or deliveries and its ACK collector wake each
/// other without crossing threads, while clients still run in parallel (docs/bench/JOURNAL.md, "A
/// thread per benchmark client"). `body` gets the sender with which it says that its client is
/// connected and its queue open. Returns the receiver of that signal and the thread.
///
/// Errors: the thread cannot be started.
pub fn on_own_thread<T, F, Fut>(
    name: String,
    body: F,
) -> anyhow::Result<(oneshot::Receiver<()>, ClientThread<T>)>
where
    T: Send + 'static,
    F: FnOnce(oneshot::Sender<()>) -> Fut + Send + 'static,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let (ready_tx, ready_rx) = oneshot::channel();
    let (done_tx, done_rx) = oneshot::channel();
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(move || {
            let result = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime.block_on(body(ready_tx)),
                Err(e) => Err(anyhow::Error::new(e).context("cannot start a tokio runtime")),
            };
            let _ = done_tx.send(result);
        })
        .with_context(|| format!("cannot start thread {name}"))?;
    Ok((ready_rx, done_rx))
}

/// Waits until `thread`'s client says it is ready, then keeps the thread in `threads`.
///
/// Errors: the client's own (no broker, queue refused) when the thread ends without being
/// ready.
pub async fn client_ready<T>(
    ready: oneshot::Receiver<()>,
    threads: &mut Vec<ClientThread<T>>,
    thread: ClientThread<T>,
) -> anyhow::Result<()> {
    if ready.await.is_ok() {
        threads.push(thread);
        return Ok(());
    }
    finished(thread).await?;
    bail!("a bench client's thread ended before its client was ready")
}

/// What a bench client's thread returned.
///
/// Errors: the client's own, or its thread panicked.
pub async fn finished<T>(thread: ClientThread<T>) -> anyhow::Result<T> {
    thread
        .await
        .map_err(|_| anyhow::anyhow!("a bench client's thread panicked"))?
}

/// The run's start, once the caller sends it on `go`'s channel (every client is ready); `None`
/// when it dropped the sender instead (another client failed).
pub async fn wait_for_start(mut go: watch::Receiver<Option<Instant>>) -> Option<Instant> {
    go.wait_for(Option::is_some)
        .await
        .ok()
        .and_then(|start| *start)
}
