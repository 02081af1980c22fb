//! Every interleaving of the rdma_cm event hand-off (`src/verbs/routes.rs`,
//! compiled here with loom's `Mutex` and atomics): the process's event
//! thread routes an id's events while the id's task registers, receives,
//! unregisters or goes away. What must hold in every one: an event routed
//! after its token was registered reaches that token's queue, in order;
//! an event is either delivered or counted as unrouted, never both and
//! never neither; tokens are never reused.

#[allow(dead_code)]
#[path = "../src/verbs/routes.rs"]
mod routes;

/// What `routes.rs` takes its synchronisation from: loom's here.
mod routes_sync {
    pub(crate) use loom::sync::Mutex;
    pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
}

use loom::sync::mpsc::{Receiver, Sender, channel};
use loom::sync::{Arc, Mutex};
use loom::thread;
use routes::{Queue, Routes};

/// A loom channel as an id's queue.
struct LoomQueue(Sender<u32>);

impl Queue<u32> for LoomQueue {
    fn push(&self, ev: u32) -> bool {
        self.0.send(ev).is_ok()
    }
}

fn register(routes: &Routes<LoomQueue>) -> (u64, Receiver<u32>) {
    let (tx, rx) = channel();
    (routes.register(LoomQueue(tx)), rx)
}

/// The connect path: the task registers its token before the id exists,
/// then hands the id to the event thread (here: the token, through a
/// channel), which routes two events; the task receives both, in order,
/// and nothing is unrouted.
#[test]
fn events_routed_after_registration_arrive_in_order() {
    loom::model(|| {
        let routes = Arc::new(Routes::<LoomQueue>::new());
        let (token, rx) = register(&routes);
        let (id_tx, id_rx) = channel::<u64>();
        let r = Arc::clone(&routes);
        let event_thread = thread::spawn(move || {
            let token = id_rx.recv().expect("the id");
            assert!(r.route(token, 1));
            assert!(r.route(token, 2));
        });
        id_tx.send(token).expect("the event thread");
        assert_eq!(rx.recv().expect("first event"), 1);
        assert_eq!(rx.recv().expect("second event"), 2);
        event_thread.join().expect("event thread");
        assert_eq!(routes.unrouted(), 0);
    });
}

/// An id destroyed (its token unregistered) while the event thread routes
/// its last event: the event is delivered or counted, exactly once.
#[test]
fn an_event_racing_unregister_is_delivered_or_counted_once() {
    loom::model(|| {
        let routes = Arc::new(Routes::<LoomQueue>::new());
        let (token, rx) = register(&routes);
        let r = Arc::clone(&routes);
        let event_thread = thread::spawn(move || r.route(token, 7));
        routes.unregister(token);
        let sent = event_thread.join().expect("event thread");
        let delivered = rx.try_recv().ok();
        assert_eq!(delivered.is_some(), sent);
        assert_eq!(delivered.map_or(0, |_| 1) + routes.unrouted(), 1);
        assert_eq!(delivered.unwrap_or(7), 7);
    });
}

/// An id's queue whose receiving side can go away, as tokio's unbounded
/// channel's can (loom's channel does not fail a send to a dropped
/// receiver): the events, or `None` once the receiver is gone.
struct Inbox(Arc<Mutex<Option<Vec<u32>>>>);

impl Queue<u32> for Inbox {
    fn push(&self, ev: u32) -> bool {
        match self.0.lock().expect("inbox").as_mut() {
            Some(events) => {
                events.push(ev);
                true
            }
            None => false,
        }
    }
}

/// A task that went away (its receiver dropped) while the event thread
/// routes to it: `route` says false exactly when it counted the event, and
/// an event it sent was in the queue when the receiver went.
#[test]
fn an_event_racing_a_dropped_receiver_is_counted_when_not_sent() {
    loom::model(|| {
        let routes = Arc::new(Routes::<Inbox>::new());
        let inbox = Arc::new(Mutex::new(Some(Vec::new())));
        let token = routes.register(Inbox(Arc::clone(&inbox)));
        let r = Arc::clone(&routes);
        let event_thread = thread::spawn(move || r.route(token, 3));
        // The receiver goes: what it had not taken is dropped with it.
        let left = inbox.lock().expect("inbox").take().expect("not gone yet");
        let sent = event_thread.join().expect("event thread");
        assert_eq!(routes.unrouted(), u64::from(!sent));
        assert_eq!(left == vec![3], sent);
    });
}

/// Two tasks registering while the event thread routes to the first: the
/// tokens differ, each event reaches only its own queue.
#[test]
fn concurrent_registrations_get_distinct_tokens_and_their_own_events() {
    loom::model(|| {
        let routes = Arc::new(Routes::<LoomQueue>::new());
        let (a, rx_a) = register(&routes);
        let r = Arc::clone(&routes);
        let other = thread::spawn(move || {
            let (b, rx_b) = register(&r);
            assert!(r.route(b, 20));
            (b, rx_b.recv().expect("b's event"))
        });
        assert!(routes.route(a, 10));
        let (b, got_b) = other.join().expect("other task");
        assert_ne!(a, b);
        assert_eq!(got_b, 20);
        assert_eq!(rx_a.recv().expect("a's event"), 10);
        assert!(rx_a.try_recv().is_err());
        assert_eq!(routes.unrouted(), 0);
    });
}
