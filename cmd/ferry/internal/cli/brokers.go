package cli

// Open takes any broker's URL, and ferry.Open opens only the brokers whose
// packages the program links: this links all of them, for every command
// that opens its broker here (and for their tests).
import _ "github.com/ferrymq/ferry/brokers"
