-- When a queue consumer first failed to fetch a record's result by reference (decision 017).
-- The hold limit counts from here, whichever replica holds the partition and however often the
-- group rebalances or the consumer restarts. Kafka offsets are never reused, so a row left
-- behind (the record fetched later by an owner that did not know of it) never matches again;
-- the consumer deletes such rows when it starts.
CREATE TABLE consumer_held_records (
    consumer        TEXT        NOT NULL,
    topic           TEXT        NOT NULL,
    kafka_partition INTEGER     NOT NULL,
    kafka_offset    BIGINT      NOT NULL,
    first_failed_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (consumer, topic, kafka_partition, kafka_offset)
);
