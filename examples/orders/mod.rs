//! Two services talking over NATS JetStream, each with a database of its own: `orders` stores an
//! order and its `OrderPlaced` event in one transaction, and its relay publishes the event to a
//! stream; `shipping` consumes the stream into its own router and schedules each shipment
//! exactly once (`handle_once`: the shipment and the inbox record in one transaction), although
//! its warehouse call fails once and the message comes again.
//!
//! `cargo run --example orders` runs both on temporary SQLite files, against the NATS server at
//! `NATS_URL` (default `127.0.0.1:4222`, with JetStream: `nats-server -js`), on a stream of its
//! own that it deletes at the end.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::jetstream;
use outbox_core::{
    BoxError, Delivery, Handle, HandlerError, OutboxEvent, RelayConfig, router, subscriber,
};
use outbox_nats::{JetStreamConsumer, JetStreamPublisher};
use outbox_sqlx::Outbox;
use serde::{Deserialize, Serialize};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Sqlite, SqlitePool};
use uuid::Uuid;

/// An order was placed: the event the two services share.
#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "order")]
pub struct OrderPlaced {
    /// The order.
    #[outbox(aggregate_id)]
    pub order_id: Uuid,
    /// What was ordered.
    pub item: String,
    /// Where it goes.
    pub address: String,
}

// ------------------------------------------------------------------------------------------
// The orders service: its events go to JetStream.

/// Publishes the orders service's events to JetStream.
#[subscriber(events = [OrderPlaced], name = "jetstream")]
pub struct Broker(JetStreamPublisher);

impl Handle<OrderPlaced> for Broker {
    async fn handle(
        &self,
        event: &OrderPlaced,
        delivery: &Delivery<'_>,
    ) -> Result<(), HandlerError> {
        self.0.publish(delivery).await?;
        println!(
            "  orders   -> JetStream  OrderPlaced #{} ({}) on {}",
            delivery.event().id,
            event.item,
            self.0.subject(delivery.event())
        );
        Ok(())
    }
}

/// The orders service's router.
#[router(events = [OrderPlaced], database = sqlx::Sqlite)]
pub struct Orders {
    /// Shares every order.
    pub broker: Broker,
}

// ------------------------------------------------------------------------------------------
// The shipping service: it consumes the stream.

/// Schedules a shipment per order, exactly once.
#[subscriber(events = [OrderPlaced], name = "shipments")]
pub struct Shipments {
    outbox: Outbox<Sqlite, Shipping>,
    /// The warehouse's API times out once, to show a message coming again.
    warehouse_timeout: Arc<AtomicBool>,
}

impl Handle<OrderPlaced> for Shipments {
    async fn handle(
        &self,
        event: &OrderPlaced,
        delivery: &Delivery<'_>,
    ) -> Result<(), HandlerError> {
        let id = delivery.event().id;
        if self.warehouse_timeout.swap(false, Ordering::SeqCst) {
            println!(
                "  shipping <- JetStream  OrderPlaced #{id}: warehouse timed out, message comes again"
            );
            return Err(HandlerError::transient("the warehouse API timed out"));
        }
        self.outbox
            .handle_once(delivery, |mut tx| async move {
                sqlx::query("INSERT INTO shipments (order_id, item, address) VALUES ($1, $2, $3)")
                    .bind(event.order_id.to_string())
                    .bind(&event.item)
                    .bind(&event.address)
                    .execute(&mut *tx)
                    .await?;
                Ok(tx)
            })
            .await?;
        println!(
            "  shipping <- JetStream  OrderPlaced #{id}: shipment of {} to {} scheduled (attempt {})",
            event.item,
            event.address,
            delivery.attempt()
        );
        Ok(())
    }
}

/// The shipping service's router.
#[router(events = [OrderPlaced], database = sqlx::Sqlite)]
pub struct Shipping {
    /// Schedules shipments.
    pub shipments: Shipments,
}

/// What the two services hold at the end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Crossed {
    /// Orders stored by the orders service.
    pub orders: i64,
    /// Messages in the stream.
    pub messages: u64,
    /// Shipments scheduled by the shipping service.
    pub shipments: i64,
}

async fn sqlite(path: &std::path::Path) -> Result<SqlitePool, BoxError> {
    let options = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    Ok(SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await?)
}

/// Runs both services in `dir` against the NATS server at `nats_url`; returns their state.
pub async fn run(nats_url: &str, dir: &std::path::Path) -> Result<Crossed, BoxError> {
    let client = async_nats::connect(nats_url).await.map_err(|error| {
        format!(
            "no NATS server at {nats_url} ({error}): start one with JetStream (nats-server -js)"
        )
    })?;
    let jetstream = jetstream::new(client);
    let id = Uuid::new_v4().simple().to_string();
    let (stream_name, prefix) = (format!("ORDERS_EXAMPLE_{id}"), format!("example_{id}"));
    outbox_nats::ensure_stream(
        &jetstream,
        outbox_nats::stream_config(stream_name.clone(), [format!("{prefix}.>")]),
    )
    .await?;
    println!("stream {stream_name}, subjects {prefix}.>");
    let result = services(&jetstream, &stream_name, &prefix, dir).await;
    jetstream.delete_stream(&stream_name).await?;
    result
}

async fn services(
    jetstream: &jetstream::Context,
    stream_name: &str,
    prefix: &str,
    dir: &std::path::Path,
) -> Result<Crossed, BoxError> {
    // The orders service: its database, its outbox and relay.
    let orders_db = sqlite(&dir.join("orders.db")).await?;
    sqlx::query("CREATE TABLE orders (id TEXT PRIMARY KEY, item TEXT NOT NULL)")
        .execute(&orders_db)
        .await?;
    let orders: Outbox<Sqlite, Orders> = Outbox::new(orders_db.clone());
    orders.migrate().await?;
    let publisher = JetStreamPublisher::new(jetstream.clone()).with_subject_prefix(prefix);
    let relay = orders.relay(
        Orders {
            broker: Broker(publisher),
        },
        RelayConfig::default().with_poll_interval(Duration::from_millis(50)),
    )?;

    // The shipping service: another database, its inbox, and a durable consumer of the stream.
    let shipping_db = sqlite(&dir.join("shipping.db")).await?;
    sqlx::query("CREATE TABLE shipments (order_id TEXT PRIMARY KEY, item TEXT, address TEXT)")
        .execute(&shipping_db)
        .await?;
    let shipping: Outbox<Sqlite, Shipping> = Outbox::new(shipping_db.clone());
    shipping.migrate().await?;
    let stream = jetstream.get_stream(stream_name).await?;
    let durable = stream
        .create_consumer(outbox_nats::consumer_config(
            "shipping",
            &format!("{prefix}.order.>"),
            Duration::from_secs(5),
        ))
        .await?;
    let consumer = JetStreamConsumer::new(
        durable,
        Shipping {
            shipments: Shipments {
                outbox: shipping,
                warehouse_timeout: Arc::new(AtomicBool::new(true)),
            },
        },
    )
    .with_retry_delay(Duration::from_millis(200));

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let stopping = |mut stopped: tokio::sync::watch::Receiver<bool>| async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    };
    let relay_task = tokio::spawn({
        let stopped = stopped.clone();
        async move { relay.run(stopping(stopped)).await }
    });
    let consumer_task = tokio::spawn(async move { consumer.run(stopping(stopped)).await });

    // The orders service takes three orders: each order row and its event in one transaction.
    let placed = [
        ("a kettle", "1 Harbour Road"),
        ("two mugs", "5 Mill Lane"),
        ("a teapot", "1 Harbour Road"),
    ];
    for (item, address) in placed {
        let order_id = Uuid::new_v4();
        let mut tx = orders.begin().await?;
        sqlx::query("INSERT INTO orders (id, item) VALUES ($1, $2)")
            .bind(order_id.to_string())
            .bind(item)
            .execute(&mut *tx)
            .await?;
        tx.publish(&OrderPlaced {
            order_id,
            item: item.to_owned(),
            address: address.to_owned(),
        })
        .await?;
        tx.commit().await?;
        println!(
            "  orders   committed    order {} ({item}) + OrderPlaced",
            &order_id.simple().to_string()[28..]
        );
    }

    // Until every order is shipped.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let shipments = loop {
        let shipments: i64 = sqlx::query_scalar("SELECT count(*) FROM shipments")
            .fetch_one(&shipping_db)
            .await?;
        if shipments == placed.len() as i64 {
            break shipments;
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!(
                "only {shipments} of {} orders shipped in 30 s",
                placed.len()
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let _ = stop.send(true);
    relay_task.await?;
    consumer_task.await??;
    let mut stream = jetstream.get_stream(stream_name).await?;
    let crossed = Crossed {
        orders: sqlx::query_scalar("SELECT count(*) FROM orders")
            .fetch_one(&orders_db)
            .await?,
        messages: stream.info().await?.state.messages,
        shipments,
    };
    println!(
        "orders: {}, messages in the stream: {}, shipments: {}",
        crossed.orders, crossed.messages, crossed.shipments
    );
    Ok(crossed)
}
