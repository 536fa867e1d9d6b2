// `#[pg_test]`s of the times the worker's statements read as numbers (`outbox._epoch_ms`,
// `outbox._epoch_us`, src/clock.rs), against the SQL expressions they replaced.

#[pg_test]
fn times_since_the_epoch_are_those_of_extract() {
    // Times around the epochs, before 1970, at half milliseconds, and spread over the
    // range of timestamptz: each as extract(epoch FROM t) gives it, exactly (a numeric).
    let differing = Spi::get_one::<i64>(
        "WITH t AS (
             SELECT timestamptz 'epoch' + us * interval '1 microsecond' AS t
               FROM (SELECT base + delta AS us
                       FROM unnest(ARRAY[0::int8, 946684800000000, -946684800000000, 1733000000123456,
                                         -62135596800000000, 7258118400000000]) AS base,
                            generate_series(-1501::int8, 1501) AS delta) v
             UNION ALL
             SELECT timestamptz '4713-01-01 00:00:00 BC' + g * interval '97 years 3 days 0.7835 seconds'
               FROM generate_series(0, 3000) g
              WHERE timestamptz '4713-01-01 00:00:00 BC' + g * interval '97 years 3 days 0.7835 seconds'
                    < timestamptz '294000-01-01'
         )
         SELECT count(*) FROM t
          WHERE outbox._epoch_ms(t) IS DISTINCT FROM (extract(epoch FROM t) * 1000)::int8
             OR outbox._epoch_us(t) IS DISTINCT FROM (extract(epoch FROM t) * 1000000)::int8",
    )
    .unwrap();
    assert_eq!(differing, Some(0));
    let checked = Spi::get_one::<i64>(
        "SELECT count(*) FROM generate_series(0, 3000) g
          WHERE timestamptz '4713-01-01 00:00:00 BC' + g * interval '97 years 3 days 0.7835 seconds'
                < timestamptz '294000-01-01'",
    )
    .unwrap();
    assert!(checked.unwrap_or_default() > 2900, "{checked:?}");
}

#[pg_test]
fn times_without_a_number_are_null() {
    let row = Spi::get_three::<i64, i64, i64>(
        "SELECT outbox._epoch_ms('infinity'), outbox._epoch_us('-infinity'),
                outbox._epoch_us('294276-12-31 23:59:59.999999+00')",
    )
    .unwrap();
    assert_eq!(row, (None, None, None));
    let ms = Spi::get_one::<i64>("SELECT outbox._epoch_ms('294276-12-31 23:59:59.999999+00')").unwrap();
    assert_eq!(ms, Some(9_224_318_016_000_000));
    let null = Spi::get_two::<i64, i64>("SELECT outbox._epoch_ms(NULL), outbox._epoch_us(NULL)").unwrap();
    assert_eq!(null, (None, None));
}
