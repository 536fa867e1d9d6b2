-- The tables of the shop examples (examples/python, examples/rust): one order per request,
-- and the count of items sold per tenant — one row per tenant and item, which concurrent
-- turns of a tenant update (under SERIALIZABLE, the row their serialization failures are
-- about). server_pid records which server connection wrote an order. Run once, as a role
-- that may create a schema, in the database the workers serve; then make the application
-- role and grant it what it uses (examples/README.md, step 3):
--   GRANT USAGE ON SCHEMA shop TO app;
--   GRANT SELECT, INSERT, UPDATE ON shop.orders, shop.stock TO app;
-- The examples never create a stock row: each tenant they run for needs its own, or its
-- sales are counted nowhere. The row of tenant acme, which examples/README.md runs, is made
-- here; another tenant's: INSERT INTO shop.stock (tenant, item) VALUES ('globex', 'widget');
CREATE SCHEMA IF NOT EXISTS shop;
CREATE TABLE IF NOT EXISTS shop.orders (
    tenant     text NOT NULL,
    request_id text NOT NULL,
    item       text NOT NULL,
    client     text NOT NULL,
    server_pid int  NOT NULL DEFAULT pg_backend_pid(),
    PRIMARY KEY (tenant, request_id));
CREATE TABLE IF NOT EXISTS shop.stock (
    tenant text NOT NULL,
    item   text NOT NULL,
    sold   int  NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, item));
INSERT INTO shop.stock (tenant, item) VALUES ('acme', 'widget') ON CONFLICT DO NOTHING;
