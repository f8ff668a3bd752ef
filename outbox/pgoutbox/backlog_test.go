package pgoutbox

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ferrymq/ferry/internal/testenv"
	"github.com/ferrymq/ferry/outbox"
)

// plan is a node of EXPLAIN (ANALYZE, FORMAT JSON).
type plan struct {
	NodeType      string  `json:"Node Type"`
	Relation      string  `json:"Relation Name"`
	ActualRows    float64 `json:"Actual Rows"`
	ActualLoops   float64 `json:"Actual Loops"`
	RemovedFilter float64 `json:"Rows Removed by Filter"`
	Plans         []plan  `json:"Plans"`
}

// rowsRead returns, per table, the most rows one plan node read from it.
func (p plan) rowsRead(out map[string]float64) {
	if p.Relation != "" {
		out[p.Relation] = max(out[p.Relation], p.ActualRows*p.ActualLoops+p.RemovedFilter)
	}
	for _, c := range p.Plans {
		c.rowsRead(out)
	}
}

// Backlog, which the relay's metrics read at every collection, reads at most
// BacklogCountLimit rows of each table however long the backlog grows: the
// plan PostgreSQL runs, with its actual row counts, shows no scan of the
// whole table.
func TestBacklogDoesNotScanTheTable(t *testing.T) {
	url := testenv.RequirePostgres(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	schema := strings.ReplaceAll(testenv.UniqueName(t, "outbox-backlog"), "-", "_")
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `CREATE SCHEMA `+schema); err != nil {
		t.Fatal(err)
	}
	defer pool.Exec(context.Background(), `DROP SCHEMA `+schema+` CASCADE`)
	if err := Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	const n = 3 * outbox.BacklogCountLimit
	if _, err := pool.Exec(ctx, `INSERT INTO ferry_outbox (event_id, lane, destination, body, created_at)
		SELECT int8send(g), g % 64, 'q', '', now() - interval '1 hour' + g * interval '1 ms'
		FROM generate_series(1, $1::int) g`, n); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO ferry_outbox_failed (id, event_id, lane, destination, key, body, created_at, reason)
		SELECT g, int8send(g), g % 64, 'q', '', '', now(), 'refused' FROM generate_series(1, $1::int) g`, n); err != nil {
		t.Fatal(err)
	}
	for _, table := range []string{"ferry_outbox", "ferry_outbox_failed"} {
		if _, err := pool.Exec(ctx, `VACUUM ANALYZE `+table); err != nil {
			t.Fatal(err)
		}
	}

	var out []byte
	if err := pool.QueryRow(ctx, `EXPLAIN (ANALYZE, FORMAT JSON) `+backlogSQL, backlogArgs()...).Scan(&out); err != nil {
		t.Fatal(err)
	}
	var plans []struct{ Plan plan }
	if err := json.Unmarshal(out, &plans); err != nil {
		t.Fatal(err)
	}
	read := map[string]float64{}
	plans[0].Plan.rowsRead(read)
	for _, table := range []string{"ferry_outbox", "ferry_outbox_failed"} {
		if read[table] > outbox.BacklogCountLimit {
			t.Errorf("a plan node read %.0f rows of %s (of %d), want at most %d:\n%s", read[table], table, n, outbox.BacklogCountLimit, out)
		}
	}

	st, err := NewStore(pool)
	if err != nil {
		t.Fatal(err)
	}
	b, err := st.Backlog(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if b.Events != outbox.BacklogCountLimit || b.Failed != outbox.BacklogCountLimit || b.OldestAge < time.Hour-time.Minute {
		t.Fatalf("backlog %+v, want %d events and failed (counting stops there), the oldest an hour old", b, outbox.BacklogCountLimit)
	}
}
