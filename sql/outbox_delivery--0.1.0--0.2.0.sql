-- outbox_delivery 0.1.0 -> 0.2.0 (ALTER EXTENSION outbox_delivery UPDATE)
--
-- Turns the schema of 0.1.0 into the schema a fresh install of 0.2.0 creates; the upgrade
-- test compares the two (RELEASES.md, "Changing the SQL surface").

-- pg_dump keeps the per-minute delivery figures too, like every other table of the
-- extension (a restored database shows the same 5-minute metrics).
SELECT pg_catalog.pg_extension_config_dump('outbox._channel_minutes', '');
