// Package sqs runs Ferry consumers and publishers on Amazon SQS, over
// aws-sdk-go-v2 (github.com/aws/aws-sdk-go-v2/service/sqs).
//
// This package and the AWS one are both named sqs; import one of them under
// another name:
//
//	import (
//		awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
//		ferrysqs "github.com/ferrymq/ferry/sqs"
//	)
//
// # What it guarantees
//
// A message is deleted only after its handler returned nil (at least once);
// in at-most-once mode it is deleted before its handler runs. A message
// whose handler failed is made visible again after its delay with
// ChangeMessageVisibility, never deleted, so SQS delivers it again and
// counts the receive. While a handler runs, waits to run again, or is held
// by an open circuit breaker, its visibility is extended before a third of
// it is left, so nobody else gets the message; SQS keeps a message
// invisible at most 12 hours after one receive, and a handler that outlives
// that loses its message to the next receive. A consumer stopped gracefully
// runs what it received and deletes it, and leaves nothing invisible. A
// consumer that crashes leaves its messages to come back after their
// visibility timeout.
//
// # Stopping
//
// Cancelling a ReceiveMessage closes only the client's side of it: SQS
// (and ElasticMQ) keeps the long poll open until its wait time ends and
// hands it the next messages that arrive, which then stay invisible for the
// visibility timeout the receive asked for. Waiting for every open poll to
// end would make each stop take up to a wait time, so the driver makes a
// cut poll cheap instead: a long poll asks for a visibility of 3 seconds
// only, and the driver extends what it brings to the queue's visibility
// timeout as soon as it answers (one ChangeMessageVisibilityBatch per long
// poll that brings messages; while there is a backlog, receives wait a
// second and ask for the whole visibility at once). When Run's context
// ends, the driver opens no more receives, gives the open ones half a
// second to answer and hands over what they and the earlier ones brought
// (through the last Fetch, or Drain when the loop was not fetching then:
// the loop runs it within its grace); its Close, at the end of Run, gives
// short receives up to two seconds to end by themselves, makes what they
// bring visible at once (counted in [Broker.Stats].Released), and cuts a long
// poll. A message that a cut poll takes afterwards, or one whose extension
// failed, is received again by another consumer after 3 seconds, with one
// more receive counted. A process that dies mid-poll strands messages for
// those 3 seconds too, not for a visibility timeout.
//
// # When SQS cannot be reached
//
// NewConsumer makes no call to SQS: the consumer looks its queue up when
// Run starts (GetQueueUrl, GetQueueAttributes: [driver.Connector]), so one
// built while SQS is unreachable, or before its queue is created, starts
// consuming once both are there. Until then, and whenever SQS stops
// answering or the queue is deleted, the loop retries with backoff and says
// so at once: its Health is "disconnected" with the error, a WARN line names
// the queue, the endpoint and the cause, and Stats.FetchErrors counts the
// failures. A receive waits at most 3 seconds ([MaxWaitTime], rather than
// SQS's 20) and is given up 2 seconds after that, so a consumer whose
// network goes silent says so within [driver.ReportWithin] (5 s); an idle
// consumer makes one receive every 3 seconds. The errors, each naming the
// call, the queue and the endpoint (never a credential), say which case it
// is with errors.Is, as on every broker:
//
//   - [consumer.ErrSourceNotFound]: the queue does not exist (yet, or any
//     more). Retried; once a queue of that name exists, the consumer
//     consumes from it.
//   - [consumer.ErrUnreachable]: SQS did not answer (a refused or failed
//     dial, a connection cut, no answer in time; the error says what the
//     SDK's last attempt saw). Retried.
//   - [consumer.ErrRefused], marked [driver.Fatal]: SQS refused the client for
//     good: credentials or signature not accepted (InvalidClientTokenId,
//     UnrecognizedClientException, SignatureDoesNotMatch, ...), an action
//     denied (AccessDenied, AccessDeniedException), the queue's KMS key or
//     HTTPS policy refusing it. Run ends with it: no retry can fix it. A
//     queue whose visibility timeout is below [driver.MinLease] ends Run too,
//     with a *[consumer.ConfigError].
//
// The AWS error inside is reached with errors.As (for example
// *types.QueueDoesNotExist, or smithy.APIError and its code). Other
// failures (throttling, SQS's own errors) are retried with backoff.
// A consumer needs sqs:GetQueueUrl (for a queue named by name),
// sqs:GetQueueAttributes, sqs:ReceiveMessage, sqs:DeleteMessage and
// sqs:ChangeMessageVisibility on its queue.
//
// # How SQS maps onto the delivery loop
//
// Ferry's delivery loop (package consumer) does everything that is the same
// on every broker; the driver here only moves messages:
//
//   - Fetch: ReceiveMessage with up to ten messages. While receives come
//     back full (a backlog), the driver keeps as many open at once as fill
//     the loop's room for messages in flight ([consumer.WithMaxInFlight]), ten
//     messages each and no more ([WithMaxReceivers] bounds them), counting
//     the ones still open and the messages received and not yet handed
//     over, each waiting at most a second; with room for less than ten it
//     waits a few milliseconds for acks to make more, so receives stay
//     full. Once a receive comes back short, it keeps a single long poll
//     open (WaitTimeSeconds 3, [MaxWaitTime]; [WithWaitTime]), which answers
//     as soon as a message arrives. Fetch hands over a receive's messages
//     as soon as that receive answers: the others go on polling, and what
//     they bring waits for the next Fetch, its visibility extended should
//     it wait a third of it. Every receive asks for the visibility the
//     driver counts with (VisibilityTimeout: the queue's visibility timeout
//     when the driver first looked the queue up, which is the driver's
//     Lease; a long poll asks for 3 seconds and is extended to the Lease
//     when it answers, see Stopping), so a later change of the queue's
//     attribute does not shorten a lease the consumer relies on. The
//     call's deadline is 2 seconds above the wait, and a client whose HTTP
//     timeout is shorter, whether the SDK's BuildableClient or a plain
//     *http.Client with a Timeout, is not refused: receives get a copy of it
//     whose timeout outlives the poll, other calls keep the client's own. (A
//     poll the HTTP timeout cut would stay open in SQS and take the next
//     messages.) Receives are opened only for a Fetch that waits, so an
//     open breaker or a full consumer stops them.
//   - FIFO queues: SQS hands out no message of a group while another of it
//     is in flight, so receives there go one at a time. While the consumer
//     holds messages, their groups are closed to every receive: one that
//     waited would wait for the consumer's own acks (and, on ElasticMQ,
//     slow the deletes that open the group again, while receives waiting
//     side by side stall it). The driver then probes for other groups with
//     a receive that does not wait, when more may be open: after a probe
//     that came back full, after a Settle that left other messages held,
//     or a second after a probe that came back short. Holding nothing, it
//     receives as on a standard queue, and a group whose messages were just
//     deleted is received again at once, as fast as a loop of one receive
//     and one delete.
//   - Message: ID is the MessageId; Deliveries is ApproximateReceiveCount
//     (so Message.Attempt counts receives by other processes too);
//     PublishedAt is SentTimestamp; Headers are the message attributes;
//     Offset is -1. On a standard queue Lane is ""; on a FIFO queue Lane is
//     the MessageGroupId, and SQS and the loop together keep each group in
//     order. [consumer.Message.As] with a *types.Message target gives the
//     message as ReceiveMessage returned it.
//   - FIFO receives that fail (an answer lost on the way) are retried with
//     the same ReceiveRequestAttemptId within five minutes, so SQS hands the
//     same messages over again instead of holding their group invisible.
//   - Settle: acks go out as DeleteMessageBatch, ten entries a call, several
//     calls at once; a batch of fewer than ten that follows the last one
//     within a few milliseconds waits that long first ([WithSettleWindow]), so
//     that under load deletes go out full. Acks decided while a Settle call
//     is out go in a further one as soon as they fill a batch of ten (up to
//     four calls out at once), rather than waiting for the first, and a
//     call of more than ten takes whole tens (the rest go with the next
//     one), so that no call is split into a short one. A return is
//     ChangeMessageVisibilityBatch with the delay in whole seconds, rounded
//     up, at least one second for a message whose handler ran (never a hot
//     loop of zero-visibility returns), within the 12 hours. SQS answers
//     batch calls with HTTP 200 and a list of failed entries: entries that
//     failed through SQS's fault are tried once more, and the rest are
//     reported to the loop exactly, by index ([driver.SettleError]); the
//     other entries stand.
//   - Extend: ChangeMessageVisibilityBatch with the queue's visibility
//     timeout (the driver's Lease), up to what is left of the 12 hours. A
//     receipt handle SQS no longer takes (ReceiptHandleIsInvalid,
//     InvalidParameterValue: its visibility ran out before the extension)
//     ends that message's extension quietly; [Broker.Stats] counts it in
//     LeasesLost, and a buffered message whose extension came back so is
//     not handed to the loop. An extension SQS refuses for going past the
//     12 hours (InvalidParameterValue for parameter VisibilityTimeout) is
//     counted in VisibilityCapped.
//   - Revoke: never; SQS does not take a receipt handle back before its
//     visibility runs out.
//   - Lag: GetQueueAttributes ApproximateNumberOfMessages and
//     ApproximateNumberOfMessagesDelayed (waiting),
//     ApproximateNumberOfMessagesNotVisible (in flight, for every consumer
//     of the queue); the loop's Health.Lag, the ferry.consumer.lag metric
//     and ferry lag all say their sum, the messages not yet deleted. The
//     age of the oldest waiting message is estimated from the SentTimestamp
//     of the messages received last (CloudWatch's
//     ApproximateAgeOfOldestMessage is the exact figure).
//   - Errors: see When SQS cannot be reached.
//
// # Publishing
//
// [Broker.Publish] sends with SendMessageBatch, ten messages or 1 MiB a call,
// and returns nil only once SQS took every message; a partial failure is a
// *[consumer.PublishError] naming each failed message. On a FIFO queue the
// Key is the MessageGroupId (a message without one is refused, there is no
// default group) and the ID the MessageDeduplicationId. With
// [WithFairQueues], a standard queue's messages carry their Key as the
// MessageGroupId too, which SQS fair queues use to keep one noisy tenant
// from holding back the others (order is still not kept).
//
// SQS carries less than a [consumer.Message] holds: a body of text only, ten
// message attributes, group ids of printable ASCII. What does not fit
// travels in one binary attribute named [MetaAttribute] ("ferry"), present
// only when needed: headers beyond the attributes left (user headers take
// the native attributes first, ferry-* ones such as DeadLetter's after), headers
// whose names or values SQS refuses, the key on a standard queue, a key
// that is not a valid group id (the group id is then a hash of it), and a
// body that is not SQS text, which is sent base64-encoded and so takes 4/3
// of its size. A dead-lettered message thus keeps every header on SQS. A
// message whose body and attributes exceed the queue's
// MaximumMessageSize is refused with [ErrMessageTooLarge] before any call,
// never truncated.
//
// # Using it
//
// Build an *awssqs.Client the usual way (config.LoadDefaultConfig and
// awssqs.NewFromConfig take the default credential chain, region and
// endpoint), pass it to New, and use the Broker as the Publisher of
// [consumer.DeadLetter], the outbox relay or your own code, and NewConsumer
// for each queue to consume (neither New nor NewConsumer calls SQS). A consumer keeps up to
// consumer.WithMaxInFlight/10 receives and several batch calls open at
// once: give the client's HTTP transport enough idle connections
// (MaxIdleConnsPerHost; the SDK's default is 10). With too few, connections
// are closed and opened all the time, and a receive whose answer is cut on
// a closing connection leaves its messages invisible until their
// visibility timeout (aws-sdk-go-v2 issue 2737).
//
// # Opening from a URL
//
//	sqs://[KEY:SECRET@][HOST:PORT][?region=REGION&tls=false]
//	https://sqs.REGION.amazonaws.com/ACCOUNT/QUEUE
//
// ferry.Open opens SQS, or a server that speaks its API, from a URL in a
// program that imports this package (blank, or
// github.com/ferrymq/ferry/brokers, when the program names no sqs
// identifier), with a client built as above. A NewConsumer source, and a
// Publish destination, is a queue's name or URL.
//
// sqs:// without a host is Amazon SQS, in the region of the default AWS
// configuration (AWS_REGION, ~/.aws/config) or of the region parameter,
// with the default credential chain. With HOST:PORT, the host is the
// endpoint: an SQS-compatible server such as ElasticMQ or LocalStack at
// https://HOST:PORT, or http://HOST:PORT with tls=false. (There is no
// endpoint parameter: the host is it.) KEY:SECRET, when given, are static
// credentials (an access key id and its secret) instead of the default
// chain. Query parameters of sqs://:
//
//   - region=REGION: the AWS region to sign for, such as eu-west-1.
//     Default the AWS configuration's; one of the two is needed.
//   - tls=true|false: false speaks plain http to HOST:PORT. Default true.
//
// An SQS queue URL, https://sqs.REGION.amazonaws.com/ACCOUNT/QUEUE, opens
// Amazon SQS in that region with the default credential chain; it takes no
// query parameters.
package sqs
