package demo_test

import (
	"context"
	"fmt"
	"time"

	"github.com/ferrymq/ferry/cmd/ferry/internal/demo"
)

// A whole run in a few seconds, printing nothing but what the verdict says.
func ExampleRun() {
	cfg := demo.DefaultConfig()
	cfg.Orders = 40
	cfg.Steady, cfg.Slow, cfg.Failing, cfg.Protected = time.Second, time.Second, 500*time.Millisecond, time.Second
	cfg.Recovered = 30 * time.Second
	cfg.SlowLatency = time.Second
	cfg.Quiet = true // cfg.Out is nil: nothing is printed

	v, err := demo.Run(context.Background(), cfg)
	if err != nil {
		panic(err)
	}
	fmt.Println("all invariants hold:", v.OK())
	fmt.Println("orders:", v.Orders, "poison:", v.Poison, "paid:", v.Paid)
	// Output:
	// all invariants hold: true
	// orders: 40 poison: 4 paid: 36
}
